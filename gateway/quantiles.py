"""Quantiles of latency samples: the p95 by nearest rank, the rank a p95 is at least with 95% confidence, and a
quantile of a window without some tenants' samples.

The rollout guards read these (gateway/rollout/guards.py): a candidate's p95 is judged by `confident_rank`, and a
breach is tested without each contesting tenant's samples in turn. The ladder's dispatch-wait p95 (gateway/ladder/
signals.py) asks whether a few tenants' waits stand out of the others'. Either way a quantile without some tenants
costs binary searches over the sorted window and their sorted samples (`kth_without`), not a sort.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

CONFIDENCE = 0.95  # a latency ratio breaches only where the candidate's p95 is that high with this confidence
RANKS_CACHED = 4096  # confident_rank's memo: one entry per sample count a window can hold (guards' MAX_SAMPLES)
T = TypeVar("T", bound=Hashable)  # whose sample it is


def p95(values: list[float]) -> float | None:
    """The 95th percentile by nearest rank (the smallest value with 95% of the values at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


@functools.lru_cache(maxsize=RANKS_CACHED)
def confident_rank(n: int) -> int:
    """The rank r (1-based) of the candidate's sample that the p95 of its latency is at least, with 95% confidence:
    the largest r with P(at least r of n samples at or below the true p95) >= CONFIDENCE, the number at or below being
    Binomial(n, 0.95); at least 1. A p95 read from a few dozen samples is their second-largest, which one stall
    shared by both versions can set: on a loaded two-core host, 1 run in 4 of the end-to-end steering test rolled
    back its healthy canary that way (p95 0.177 s over the baseline's 0.032 s, from 30 candidate samples). The bound
    needs several of the candidate's samples slow, and approaches the plain p95 as samples grow (30 samples: the
    26th of 30; 1,000: the 938th)."""
    tail, r = 0.0, n  # tail: P(Binomial(n, 0.95) >= r), summed from r = n down
    while r >= 1:
        tail += math.exp(math.lgamma(n + 1) - math.lgamma(r + 1) - math.lgamma(n - r + 1)
                         + r * math.log(0.95) + (n - r) * math.log(0.05))
        if tail >= CONFIDENCE:
            return r
        r -= 1
    return 1


def kth_without(ordered: Sequence[float], gone: Sequence[Sequence[float]], k: int) -> float:
    """The k-th smallest (1-based) of `ordered` (sorted) once the values of each sorted list in `gone` (taken from
    `ordered`) are taken out: binary searches, no copy. The answer is the first value with k of those left at or
    below it; k must be at least 1 and at most what is left."""
    lo, hi = k - 1, k - 1 + sum(len(g) for g in gone)
    while lo < hi:
        mid = (lo + hi) // 2
        x = ordered[mid]
        if bisect_right(ordered, x) - sum(bisect_right(g, x) for g in gone) >= k:
            hi = mid
        else:
            lo = mid + 1
    return ordered[lo]


class Ranked(Generic[T]):
    """One version's samples of one latency in one prompt band, sorted, and each tenant's sorted apart: its p95
    without any one tenant's samples costs a few binary searches (`kth_without`), not a sort. A tenant of None is
    never left out."""

    def __init__(self, samples: list[tuple[float, T]]) -> None:
        samples.sort(key=lambda s: s[0])
        self.values = [v for v, _ in samples]
        self.of: dict[T, list[float]] = {}  # tenant -> its samples, ascending
        for value, tenant in samples:
            self.of.setdefault(tenant, []).append(value)

    def _gone(self, without: T | None) -> Sequence[float]:
        return self.of.get(without, ()) if without is not None else ()

    def size(self, without: T | None = None) -> int:
        return len(self.values) - len(self._gone(without))

    def p95(self, without: T | None = None, *, confident: bool = False) -> float | None:
        """`p95` of the samples but `without`'s (None: all of them); `confident`: the value the p95 is at least with
        CONFIDENCE (`confident_rank`), what a candidate is judged by."""
        gone = self._gone(without)
        n = len(self.values) - len(gone)
        if n <= 0:
            return None
        return kth_without(self.values, [gone], confident_rank(n) if confident else math.ceil(0.95 * n))
