"""An error bound the operator sets (`cache.max_error_rate` per plan): the similarity a semantic candidate must
reach is learned from the tenant's own traffic, so that the share of semantic hits that were wrong stays at or
below the bound (vCache's idea, ICLR 2026, kept per tenant rather than per entry: one entry is rarely asked
often enough to learn its own threshold, a tenant's traffic is).

Labels. A semantic candidate was right when the tier, asked the new question, answers what the cached entry says
(`same_answer`: the same text up to case and spacing; only deterministic requests reach the semantic layer, so
a right hit is the very answer the tier would have given, and a paraphrase answered in other words counts as
wrong: the bound errs on the safe side). Two sources, both off the response's path:
- near misses: a candidate the guards accepted but that was below the tenant's threshold, so the tier answered
  anyway; its fresh answer is compared with the candidate's at no cost. Weight 1.
- shadow checks: a sampled share (`shadow_rate`) of semantic hits is also sent to the tier, billed to us and
  never to the tenant; weight 1 / shadow_rate, so the hits count as often as they happened (Horvitz-Thompson).
The latest WINDOW labels are kept (bounded memory): older evidence ages out, so when the tenant's traffic
changes, the threshold follows.

Threshold: the lowest similarity t at or above `floor` (EXPLORE_BELOW under the plan's static threshold) such
that the labels at or above t show an error rate whose upper confidence bound (Wilson, one-sided, Z standard
errors, on the effective sample size of the weighted labels) is at most the bound, with at least `min_evidence`
effective labels there. When no t qualifies, there are no semantic hits (exact ones only) until the evidence says
otherwise. With fewer than `min_labels` labels the tenant's static threshold decides, as it did before the bound
existed.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from cache.results import Hit, LookupResult, Miss, TenantPolicy

WINDOW = 4096  # labels kept per tenant
RECOMPUTE_EVERY = 16  # labels between two threshold searches (each O(WINDOW log WINDOW), microseconds)
Z = 1.0  # standard errors of margin above the observed error rate (one-sided)
MIN_LABELS = 64  # before this many labels the static threshold decides
COMPARE_MAX_CHARS = 16_384  # answers are compared on their first this many characters (linear, bounded)
NEVER = math.inf  # the threshold while the evidence admits no semantic hit
EXPLORE_BELOW = 0.1  # near misses are labelled down to this far below the plan's threshold (where it may go)


def same_answer(cached: str, fresh: str) -> bool:
    """Whether two answers say the same thing, as far as this cheap check can tell: equal up to case and spacing."""
    def fold(text: str) -> str:
        return " ".join(text[:COMPARE_MAX_CHARS].split()).casefold()
    return fold(cached) == fold(fresh)


def wilson_upper(errors: float, n: float, z: float = Z) -> float:
    """One-sided Wilson upper bound of an error rate seen as `errors` in `n` (effective) trials."""
    if n <= 0:
        return 1.0
    p = min(max(errors / n, 0.0), 1.0)
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z2 / n))


@dataclass(frozen=True, slots=True)
class BoundState:
    """What the bound says now, for metrics and the admin's tenant report."""

    max_error_rate: float
    threshold: float | None  # None: too few labels yet, the static threshold decides; inf: no semantic hits
    labels: int  # in the window
    estimated_error: float | None  # of the hits shadow-checked in the window (None: none checked yet)
    checked_hits: int


class ErrorBound:
    """One tenant's learned threshold. Not thread-safe: the gateway calls it from its event loop."""

    def __init__(self, max_error_rate: float, *, floor: float, window: int = WINDOW, min_labels: int = MIN_LABELS,
                 min_evidence: float | None = None, z: float = Z) -> None:
        if not 0 < max_error_rate < 1:
            raise ValueError(f"max_error_rate is a fraction between 0 and 1, not {max_error_rate}")
        self.max_error_rate = max_error_rate
        self.floor = floor
        self.min_labels = min_labels
        # enough labels that a clean record can show the bound at all: z^2 / n <= rate
        self.min_evidence = min_evidence if min_evidence is not None else z * z / max_error_rate
        self.z = z
        # the window, a ring: similarity, 1.0 for a wrong answer, weight, whether it was a served hit
        self._labels = np.zeros((window, 4), dtype=np.float64)
        self._count = self._next = 0
        self._since = 0
        self._threshold: float | None = None

    def observe(self, similarity: float, right: bool, *, weight: float = 1.0, hit: bool = False) -> None:
        """A labelled candidate: `hit` when it was served and shadow-checked (then weight = 1 / sampling rate)."""
        if not (math.isfinite(similarity) and weight >= 1.0):
            raise ValueError("a label needs a finite similarity and a weight of at least 1")
        self._labels[self._next] = (similarity, 0.0 if right else 1.0, weight, 1.0 if hit else 0.0)
        self._next = (self._next + 1) % len(self._labels)
        self._count = min(self._count + 1, len(self._labels))
        self._since += 1
        if self._since >= RECOMPUTE_EVERY or (self._threshold is None and self._count >= self.min_labels):
            self._since = 0
            self._threshold = self._search() if self._count >= self.min_labels else None

    def move_floor(self, floor: float) -> None:
        self.floor = floor
        if self._count >= self.min_labels:
            self._threshold = self._search()

    def threshold(self, static: float) -> float:
        """The similarity a candidate must reach now (`static`, the plan's, until there are labels enough)."""
        return static if self._threshold is None else self._threshold

    def state(self) -> BoundState:
        checked = self._labels[:self._count][self._labels[:self._count, 3] > 0]
        total = checked[:, 2].sum()
        error = float((checked[:, 1] * checked[:, 2]).sum() / total) if total else None
        return BoundState(self.max_error_rate, self._threshold, self._count, error, len(checked))

    def _search(self) -> float:
        """The lowest similarity whose labels at or above it keep the bound (NEVER when none does)."""
        data = self._labels[:self._count]
        data = data[data[:, 0] >= self.floor]
        if not len(data):
            return NEVER
        data = data[np.argsort(-data[:, 0], kind="stable")]
        weights = np.cumsum(data[:, 2])
        errors = np.cumsum(data[:, 1] * data[:, 2])
        n_eff = weights * weights / np.cumsum(data[:, 2] ** 2)
        last = np.append(data[1:, 0] != data[:-1, 0], True)  # a threshold keeps all labels of equal similarity
        upper = _wilson_upper(errors / weights, n_eff, self.z)
        keeps = np.flatnonzero(last & (n_eff >= self.min_evidence) & (upper <= self.max_error_rate))
        return float(data[keeps[-1], 0]) if len(keeps) else NEVER  # the lowest similarity that keeps the bound


def _wilson_upper(p: np.ndarray, n: np.ndarray, z: float) -> np.ndarray:
    """`wilson_upper` over arrays of observed rates and (positive) effective sizes."""
    z2 = z * z
    spread = z * np.sqrt(np.clip(p * (1 - p), 0, None) / n + z2 / (4 * n * n))
    return np.minimum(1.0, (p + z2 / (2 * n) + spread) / (1 + z2 / n))


class TenantBounds:
    """Each tenant's `ErrorBound`, made when its first lookup with a bound arrives and made again when its plan's
    bound changes (a changed static threshold keeps the labels). Thread-safe (lookups read thresholds in worker
    threads)."""

    def __init__(self, explore_below: float = EXPLORE_BELOW) -> None:
        self.explore_below = explore_below
        self._bounds: dict[str, ErrorBound] = {}
        self._checked: dict[str, bool] = {}  # tenant -> whether its bound's labels passed the meaning check
        self._lock = threading.Lock()

    def get(self, tenant: str, max_error_rate: float | None, static: float, *,
            meaning_check: bool = False) -> ErrorBound | None:
        """`meaning_check`: whether the plan's candidates also pass the meaning check; its labels are only of
        candidates the check accepts, so turning it on or off starts the evidence anew too."""
        if max_error_rate is None:
            return None
        bound = self._bounds.get(tenant)
        floor = static - self.explore_below
        if bound is None or (bound.max_error_rate, self._checked.get(tenant)) != (max_error_rate, meaning_check):
            with self._lock:  # another bound: the evidence starts anew
                bound = self._bounds[tenant] = ErrorBound(max_error_rate, floor=floor)
                self._checked[tenant] = meaning_check
        elif bound.floor != floor:  # another static threshold: the same evidence, searched down to the new floor
            with self._lock:
                bound.move_floor(floor)
        return bound

    def observe(self, bound: ErrorBound, similarity: float, right: bool, *, weight: float = 1.0,
                hit: bool = False) -> None:
        with self._lock:
            bound.observe(similarity, right, weight=weight, hit=hit)

    def label(self, result: LookupResult, policy: TenantPolicy, fresh: str) -> bool | None:
        """Compare the tier's fresh answer with the candidate the lookup found (a near miss below the learned
        threshold, or a semantic hit sampled for a shadow check) and teach the tenant's bound. Returns whether
        the candidate was right (None: nothing to label)."""
        if isinstance(result, Miss) and result.near is not None:
            near = result.near
            tenant, similarity, cached, weight, hit = near.tenant, near.similarity, near.response, 1.0, False
        elif isinstance(result, Hit) and result.shadow_rate > 0:  # weighed by the rate it was sampled at
            tenant, similarity, cached = result.entry.tenant, result.similarity, result.response
            weight, hit = 1.0 / result.shadow_rate, True
        else:
            return None
        bound = self.get(tenant, policy.max_error_rate, policy.similarity_threshold,
                         meaning_check=policy.meaning_check)
        if bound is None:
            return None
        right = same_answer(cached, fresh)
        self.observe(bound, similarity, right, weight=weight, hit=hit)
        return right

    def states(self) -> dict[str, BoundState]:
        with self._lock:
            return {tenant: bound.state() for tenant, bound in self._bounds.items()}
