"""The cheap check a cascade runs on a cheaper tier's answer, and the tier it retries on.

An answer fails when it is empty, when it stopped at the output cap that the tier's context left (the
model ran out of room, not out of things to say: a tier with a larger context may finish it), or when
its mean token log-probability is below the plan's threshold (the model was unsure).

Log-probabilities are asked for (`logprobs: true`) only where the plan sets a threshold, and read from
OpenAI's `choices[].logprobs.content[]`, which our engine (engine/server.py) and vLLM both return. An
upstream that returns none is checked for empty and truncated answers only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tiers.catalogue import TierCatalogue, TierSpec


@dataclass(frozen=True)
class Verdict:
    code: str  # empty | truncated | low_logprob (a metric label)
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
