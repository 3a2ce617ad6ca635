"""The check a cascade runs on a cheaper tier's answer, the engine's signals it reads, and the tier it retries on.

An answer fails when it is empty, when it stopped at the output cap that the tier's context left (the
model ran out of room, not out of things to say: a tier with a larger context may finish it), when its
mean token log-probability is below the plan's fixed threshold, or when its calibrated confidence (the
router's artifact, tiers/difficulty.py's `CascadeCalibration`) falls short of what the plan's quality floor
needs.

The confidence reads `AnswerSignals`: what the engine's own log-probabilities say of the answer, gathered
token by token in constant memory: the chosen tokens' log-probabilities (mean, minimum, share below ½), the
entropy of each next-token distribution estimated from its top alternatives (the top-k probabilities plus one
bucket for the rest: a lower bound that orders distributions as the true entropy mostly does), the margin
between the two most likely tokens (a near tie is where a quantized or distilled copy goes another way), and
the answer's length and whether it stopped by itself. Training (training/confidence.py) and serving compute
them with this same code.

Log-probabilities are read from OpenAI's `choices[].logprobs.content[]` (`logprob` and `top_logprobs`), which
our engine (engine/server.py) and vLLM both return. An upstream that returns none is checked for empty and
truncated answers only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tiers.catalogue import TierCatalogue, TierSpec


@dataclass(frozen=True)
class Verdict:
    code: str  # empty | truncated | low_logprob | low_confidence (a metric label)
    why: str  # for the route reason


def check_answer(text: str, *, finish_reason: str | None, cap_by_context: bool, mean_logprob: float | None,
                 min_mean_logprob: float | None) -> Verdict | None:
    """Why the answer should be retried on a dearer tier, or None when it passes."""
    if not text.strip():
        return Verdict("empty", "empty answer")
    if finish_reason == "length" and cap_by_context:
        return Verdict("truncated", "truncated by the context limit")
    if min_mean_logprob is not None and mean_logprob is not None and mean_logprob < min_mean_logprob:
        return Verdict("low_logprob", f"mean token log-probability {mean_logprob:.2f} < {min_mean_logprob:g}")
    return None


def check_confidence(values: dict[str, float] | None, *, calibration: Any, cheap: str, strong: str,
                     floor: float, early: bool = False) -> tuple[Verdict | None, str | None]:
    """The calibrated check of a `cheap` answer that a cascade would retry on `strong`: a verdict when its
    confidence falls short of the plan's `floor`, and a note for the route reason either way (None when the
    calibration has nothing for this pair: the answer stands; a note when the answer lacks a signal it reads).
    With `early`, the look-ahead's head and thresholds read `values` of the answer's first tokens.
    `calibration` is tiers/difficulty.py's CascadeCalibration (not imported here: it needs numpy)."""
    if calibration is None or values is None:
        return None, None
    found = calibration.early_pair(cheap, strong) if early else calibration.pair(cheap, strong)
    if found is None:
        return None, None
    head, pair = found
    score = head.score(values)
    if score is None:
        return None, f"{cheap}'s confidence not checked (the tier sent no top log-probabilities)"
    threshold, expected = pair.threshold(floor), head.calibrated(score)
    read = f" on its first {calibration.lookahead.tokens} tokens" if early else ""
    if threshold is None or score < threshold:
        needs = min(math.ceil(round(floor * 100, 6)) / 100, pair.strong_fidelity)  # the grid's floor, capped
        return (Verdict("low_confidence", f"calibrated confidence {expected:.2f}{read} < {needs:.2f} needed for "
                                          f"floor {floor:g}"), None)
    return None, f"calibrated confidence {expected:.2f}{read} keeps floor {floor:g}"


def outcome_values(outcome: Any) -> dict[str, float] | None:
    """The signals of a gateway attempt's outcome (gateway/pipeline/meter.py's Outcome): what the meter gathered
    (its `signals`, see `values_of`), else what its mean log-probability, token count and finish reason
    give; None without log-probabilities."""
    stopped = outcome.finish_reason == "stop"
    signals = getattr(outcome, "signals", None)
    if isinstance(signals, AnswerSignals) and signals.num_tokens:
        return values_of(signals, stopped=stopped)
    if outcome.mean_logprob is None:
        return None
    return {"mean_logprob": float(outcome.mean_logprob), "log_tokens": math.log1p(outcome.output_tokens),
            "stopped": float(stopped)}


def next_dearer(catalogue: TierCatalogue, current: TierSpec, allowed: Iterable[str], unavailable: Iterable[str],
                verdict: Verdict) -> TierSpec | None:
    """The cheapest allowed, available tier dearer than `current` (with a larger context, for a truncated
    answer: the same context would cut it again)."""
    allowed, down = set(allowed), set(unavailable)
    ordered = catalogue.by_price()
    at = next(i for i, t in enumerate(ordered) if t.name == current.name)
    for tier in ordered[at + 1:]:
        if tier.name not in allowed or tier.name in down:
            continue
        if verdict.code == "truncated" and tier.context_limit <= current.context_limit:
            continue
        return tier
    return None


def sum_logprobs(chunk_logprobs: Iterable[object]) -> tuple[float, int]:
    """Sum and count of token log-probabilities in one choice's `logprobs` field (OpenAI's shape)."""
    total, n = 0.0, 0
    for lp in chunk_logprobs:
        if isinstance(lp, dict):
            for tok in lp.get("content") or []:
                if isinstance(tok, dict) and isinstance(tok.get("logprob"), int | float):
                    total += float(tok["logprob"])
                    n += 1
    return total, n


# ---- the engine's signals ----

LOW_PROB = math.log(0.5)  # a chosen token the model gave less than even odds
LOW_MARGIN = 0.5  # nats between the two most likely tokens: a near tie
SIGNAL_FEATURES = ("mean_logprob", "min_logprob", "low_prob_frac", "mean_entropy", "max_entropy", "mean_margin",
                   "min_margin", "low_margin_frac", "log_tokens", "stopped")
ALTERNATIVES_FEATURES = frozenset({"mean_entropy", "max_entropy", "mean_margin", "min_margin", "low_margin_frac"})


def entropy_estimate(top: Sequence[float]) -> float:
    """Entropy (nats) of a next-token distribution known by its top log-probabilities: −Σ p log p over them
    plus the rest of the mass as one more outcome. A lower bound on the true entropy."""
    probs = [math.exp(v) for v in top]
    rest = max(0.0, 1.0 - sum(probs))
    h = -sum(p * v for p, v in zip(probs, top, strict=True))
    return h - rest * math.log(rest) if rest > 0 else h


class AnswerSignals:
    """The log-probability signals of one answer, token by token (constant memory: sums, minima, counts)."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_with_top = 0  # tokens that came with at least two alternatives (entropy and margin need them)
        self._sum_lp = self._sum_h = self._sum_margin = 0.0
        self._min_lp = self._max_h = self._min_margin = math.nan
        self._low_prob = self._low_margin = 0

    def add(self, logprob: float, top: Sequence[float] = ()) -> None:
        """One token: its log-probability and its alternatives' (most likely first, as the engine sends them)."""
        if not math.isfinite(logprob):
            logprob = -100.0  # a token the model thought impossible: the least sure there is, kept finite
        self.num_tokens += 1
        self._sum_lp += logprob
        self._min_lp = logprob if math.isnan(self._min_lp) else min(self._min_lp, logprob)
        self._low_prob += logprob < LOW_PROB
        alternatives = sorted((v for v in top if math.isfinite(v)), reverse=True)
        if len(alternatives) < 2:
            return
        self.num_with_top += 1
        h, margin = entropy_estimate(alternatives), alternatives[0] - alternatives[1]
        self._sum_h += h
        self._max_h = h if math.isnan(self._max_h) else max(self._max_h, h)
        self._sum_margin += margin
        self._min_margin = margin if math.isnan(self._min_margin) else min(self._min_margin, margin)
        self._low_margin += margin < LOW_MARGIN

    def add_openai(self, logprobs: object, *, limit: int | None = None) -> None:
        """The tokens of one choice's `logprobs` field, OpenAI's shape: {"content": [{"logprob", "top_logprobs"}]};
        with `limit`, only until the signals hold that many tokens."""
        if not isinstance(logprobs, dict):
            return
        for tok in logprobs.get("content") or []:
            if limit is not None and self.num_tokens >= limit:
                return
            if not isinstance(tok, dict) or not isinstance(tok.get("logprob"), int | float):
                continue
            alternatives = tok.get("top_logprobs")  # an upstream's: anything but a list is none
            top = [float(t["logprob"]) for t in (alternatives if isinstance(alternatives, list) else ())
                   if isinstance(t, dict) and isinstance(t.get("logprob"), int | float)]
            self.add(float(tok["logprob"]), top)

    @property
    def mean_logprob(self) -> float | None:
        return self._sum_lp / self.num_tokens if self.num_tokens else None

    @property
    def has_alternatives(self) -> bool:
        """Every token came with its top alternatives (what the calibrated confidence was trained on)."""
        return self.num_tokens > 0 and self.num_with_top == self.num_tokens

    def features(self, *, stopped: bool) -> list[float]:
        """The SIGNAL_FEATURES vector; None of it is defined for an answer with no tokens (check that first)."""
        n, m = max(self.num_tokens, 1), max(self.num_with_top, 1)
        no_top = self.num_with_top == 0
        return [self._sum_lp / n, 0.0 if math.isnan(self._min_lp) else self._min_lp, self._low_prob / n,
                self._sum_h / m, 0.0 if no_top else self._max_h, self._sum_margin / m,
                0.0 if no_top else self._min_margin, self._low_margin / m, math.log1p(self.num_tokens),
                float(stopped)]


def values_of(signals: AnswerSignals, *, stopped: bool) -> dict[str, float] | None:
    """The named SIGNAL_FEATURES of gathered signals; those that need alternatives only when every token came
    with them (a head that reads them then scores None rather than a made-up value); None without tokens."""
    if not signals.num_tokens:
        return None
    values = dict(zip(SIGNAL_FEATURES, signals.features(stopped=stopped), strict=True))
    if signals.has_alternatives:
        return values
    return {name: v for name, v in values.items() if name not in ALTERNATIVES_FEATURES}


def signals_of(tokens: Iterable[tuple[float, Sequence[float]]]) -> AnswerSignals:
    """The signals of an answer given as (log-probability, top alternatives) per token."""
    signals = AnswerSignals()
    for logprob, top in tokens:
        signals.add(logprob, top)
    return signals
