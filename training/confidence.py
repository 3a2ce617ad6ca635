"""The cascade's calibration: how sure a cheaper tier is of its own answer, in units of expected fidelity, and
the score each tier pair's answers must clear for each quality floor (the `cascade` part of the artifact).

Per cheaper tier, on the training prompts' answers (greedy, with `top_logprobs` alternatives per token):

1. Signals: tiers/cascade.py's `AnswerSignals` of each answer (the same code the gateway runs on the tier's
   stream). Empty answers are left out: the cascade retries them whatever their signals.
2. Score: ridge regression from the chosen signals to the answer's fidelity (training/ridge.py, penalty by
   5-fold CV), and its out-of-fold predictions: scores made without seeing the answer they score.
3. Calibration: an isotonic (monotone) fit of the true fidelity on those out-of-fold scores, so a score
   maps to the mean fidelity of answers that scored alike. Monotone because a higher score must never mean
   a worse answer, and a linear score has no reason to be on fidelity's scale at its ends.
4. Thresholds, per pair cheap → strong (the dearer tier a cascade retries on): for each floor f of the grid,
   the lowest score whose calibrated fidelity reaches min(f, the strong tier's mean fidelity). An answer that
   clears it is expected to be at least as good as the floor asks (so the answers that stand, and with them
   the mix of kept and retried ones, keep the floor on these prompts), or as good as a retry would be on
   average: retrying on a tier that is not expected to do better only adds its price.

5. The look-ahead: the same heads and thresholds fitted on each answer's first LOOKAHEAD tokens (the whole answer
   when it is shorter, with whether it stopped), so the gateway can judge a cheap answer while it is made and
   stop one that falls short there, paying for LOOKAHEAD tokens rather than for the whole of an answer it
   throws away.

`signal_study` compares signal sets by the same cross-validation, for the benchmark's record of which signals
help.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiers.cascade import SIGNAL_FEATURES, signals_of
from tiers.difficulty import FLOOR_GRID, CascadeCalibration, ConfidenceHead, Lookahead, PairThresholds
from training.ridge import fit_head_oof
from training.router_prompts import RouterTrainingError
from training.tier_answers import Answer

# What the confidence head reads. Chosen by `signal_study` on the training prompts (BENCHMARKS.md has the
# numbers): every signal; see bench/router.py's signal table.
CONFIDENCE_FEATURES = SIGNAL_FEATURES
# The signals a gateway gets with `logprobs: true` and no `top_logprobs` (no entropy or margin).
BASIC_FEATURES = ("mean_logprob", "min_logprob", "low_prob_frac", "log_tokens", "stopped")
MIN_ANSWERS = 20  # fewer non-empty answers than this: no head for that tier
# Tokens the look-ahead reads before it judges. 16 since the first look-ahead run (session 9, bench/router.py's
# signal table: the first 16 tokens' signals had the best Spearman with fidelity on the training answers).
LOOKAHEAD = 16


def signal_values(answer: Answer, *, first_tokens: int | None = None) -> dict[str, float] | None:
    """The SIGNAL_FEATURES of one answer (of its first `first_tokens` tokens: a stream's look-ahead), or None
    when it has no text or no log-probabilities."""
    if not answer.text.strip() or not answer.logprobs:
        return None
    tokens = answer.logprobs if first_tokens is None else answer.logprobs[:first_tokens]
    stopped = answer.finish_reason == "stop" and (first_tokens is None or len(answer.logprobs) <= first_tokens)
    return dict(zip(SIGNAL_FEATURES, signals_of(tokens).features(stopped=stopped), strict=True))


def _matrix(values: Sequence[dict[str, float]], features: Sequence[str]) -> np.ndarray:
    return np.asarray([[v[f] for f in features] for v in values], dtype=np.float64).reshape(len(values),
                                                                                           len(features))


def fit_confidence(values: Sequence[dict[str, float]], fidelity: np.ndarray, *,
                   features: Sequence[str] = CONFIDENCE_FEATURES, seed: int = 0) -> tuple[ConfidenceHead, np.ndarray]:
    """The confidence head of one tier from its answers' signals and fidelity, and its out-of-fold scores."""
    from sklearn.isotonic import IsotonicRegression

    y = np.asarray(fidelity, dtype=np.float64)
    if len(values) < MIN_ANSWERS:
        raise RouterTrainingError(f"{len(values)} answers with log-probabilities; the confidence needs "
                                  f"{MIN_ANSWERS}")
    ridge, oof = fit_head_oof(_matrix(values, features), y, seed=seed)
    iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip").fit(oof, y)
    head = ConfidenceHead(list(features), ridge, np.asarray(iso.X_thresholds_, dtype=np.float64),
                          np.asarray(iso.y_thresholds_, dtype=np.float64))
    return head, oof


def threshold_for(head: ConfidenceHead, target: float) -> float | None:
    """The lowest raw score whose calibrated fidelity reaches `target` (−∞: every score; None: none)."""
    x, y = head.iso_x, head.iso_y
    if y[0] >= target:
        return -math.inf
    hits = np.nonzero(y >= target)[0]
    if len(hits) == 0:
        return None
    j = int(hits[0])  # y[j - 1] < target <= y[j]: on the segment between, np.interp is linear
    return float(x[j - 1] + (target - y[j - 1]) / (y[j] - y[j - 1]) * (x[j] - x[j - 1]))


def pair_thresholds(head: ConfidenceHead, cheap: str, strong: str, strong_fidelity: float) -> PairThresholds:
    return PairThresholds(cheap, strong, float(strong_fidelity),
                          [threshold_for(head, min(f, strong_fidelity)) for f in FLOOR_GRID])


def calibrate_cascade(answers: dict[str, list[Answer]], fidelity: dict[str, np.ndarray], reference: str,
                      order: Sequence[str], *, top_logprobs: int, seed: int = 0,
                      features: Sequence[str] = CONFIDENCE_FEATURES,
                      lookahead: int | None = LOOKAHEAD) -> CascadeCalibration:
    """Heads for every cheaper tier of `fidelity` and thresholds for every pair cheap → dearer tier of `order`
    (cheapest first, the reference last); the same on the answers' first `lookahead` tokens (None: none)."""
    means = {tier: float(np.mean(fid)) for tier, fid in fidelity.items()} | {reference: 1.0}
    training: dict[str, Any] = {"features": list(features), "tiers": {}}
    heads, pairs = _calibrate(answers, fidelity, means, order, training["tiers"], features=features, seed=seed)
    early = None
    if lookahead is not None:
        training["lookahead"] = {"tokens": lookahead, "tiers": {}}
        early = Lookahead(lookahead, *_calibrate(answers, fidelity, means, order, training["lookahead"]["tiers"],
                                                 features=features, seed=seed, first_tokens=lookahead))
    return CascadeCalibration(top_logprobs, heads, pairs, training, early)


def _calibrate(answers: dict[str, list[Answer]], fidelity: dict[str, np.ndarray], means: dict[str, float],
               order: Sequence[str], record: dict[str, Any], *, features: Sequence[str], seed: int,
               first_tokens: int | None = None) -> tuple[dict[str, ConfidenceHead], dict[str, PairThresholds]]:
    heads: dict[str, ConfidenceHead] = {}
    for tier, fid in fidelity.items():
        rows = [(v, f) for a, f in zip(answers[tier], fid, strict=True)
                if (v := signal_values(a, first_tokens=first_tokens)) is not None]
        if len(rows) < MIN_ANSWERS:
            continue
        head, oof = fit_confidence([v for v, _ in rows], np.array([f for _, f in rows]), features=features, seed=seed)
        heads[tier] = head
        record[tier] = {"answers": len(rows), "empty_or_unscored": len(fid) - len(rows),
                        "cv_rmse": head.ridge.cv_rmse, "baseline_rmse": head.ridge.baseline_rmse,
                        "beats_mean": head.ridge.beats_mean, "spearman": _spearman(oof, np.array([f for _, f in rows]))}
    pairs = {}
    for i, cheap in enumerate(order):
        if cheap not in heads:
            continue
        for strong in order[i + 1:]:
            if strong in means:
                pairs[f"{cheap}->{strong}"] = pair_thresholds(heads[cheap], cheap, strong, means[strong])
    return heads, pairs


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return 0.0 if ra.std() == 0 or rb.std() == 0 else float(np.corrcoef(ra, rb)[0, 1])


def signal_study(answers: list[Answer], fidelity: np.ndarray, feature_sets: dict[str, Sequence[str]], *,
                 seed: int = 0) -> dict[str, dict[str, float]]:
    """Per named signal set: CV RMSE, the mean's, and Spearman of out-of-fold scores with fidelity."""
    rows = [(v, f) for a, f in zip(answers, fidelity, strict=True) if (v := signal_values(a)) is not None]
    values, y = [v for v, _ in rows], np.array([f for _, f in rows])
    out = {}
    for name, features in feature_sets.items():
        head, oof = fit_confidence(values, y, features=features, seed=seed)
        out[name] = {"cv_rmse": head.ridge.cv_rmse, "baseline_rmse": head.ridge.baseline_rmse,
                     "spearman": _spearman(oof, y)}
    return out
