"""Cost–quality curves of routing policies for one tier pair weak → strong (bench/router.py reports them).

Each policy is swept from every request on weak to every request moved to strong; a point is (share on strong,
mean cost per request, mean quality). Routing moves a request to strong alone; a cascade runs every request on
weak and retries the moved ones on strong, billed for both (a look-ahead cascade pays only weak's first tokens for
a retried request; a cascade that stops at a near tie pays for the tokens made until it stopped). APGR is
RouteLLM's area under the performance gap recovered (random mixing 0.5); the same area over cost charges a
cascade for its double billing.

A stopped cascade's sweep (`stop_curve`), its saving at QUALITY_TARGET and the point a deployment picks
(`first_reaching`) are training/divergence_fit.py's, which `tiergate router train` fits the gateway's stop with:
the benchmark sweeps the same arithmetic, imported from there (its names stay importable from here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.divergence_fit import QUALITY_TARGET, Curve, saving_at_target
from training.divergence_fit import cost_at_quality as cost_at_quality
from training.divergence_fit import first_reaching as first_reaching
from training.divergence_fit import stop_curve as stop_curve


def policy_curve(order: np.ndarray, q_weak: np.ndarray, q_strong: np.ndarray, c_kept: np.ndarray,
                 c_moved: np.ndarray) -> Curve:
    """Move requests to strong in `order` (first = moved first). A kept request costs `c_kept` and earns
    `q_weak`; a moved one costs `c_moved` (strong's price, plus weak's for a cascade) and earns `q_strong`."""
    n = len(order)
    qw, qs, ck, cm = (np.asarray(a, dtype=np.float64)[order] for a in (q_weak, q_strong, c_kept, c_moved))
    k = np.arange(n + 1)
    cost = (ck.sum() + np.concatenate([[0.0], np.cumsum(cm - ck)])) / n
    quality = (qw.sum() + np.concatenate([[0.0], np.cumsum(qs - qw)])) / n
    return Curve(k / n, cost, quality)


def routing_curve(order: np.ndarray, q_weak: np.ndarray, q_strong: np.ndarray, c_weak: np.ndarray,
                  c_strong: np.ndarray) -> Curve:
    return policy_curve(order, q_weak, q_strong, c_weak, c_strong)


def cascade_curve(order: np.ndarray, q_weak: np.ndarray, q_strong: np.ndarray, c_weak: np.ndarray,
                  c_strong: np.ndarray, c_first: np.ndarray | None = None) -> Curve:
    """`c_first`: what a retried request's weak attempt cost (its whole answer unless a look-ahead cut it)."""
    first = c_weak if c_first is None else c_first
    return policy_curve(order, q_weak, q_strong, c_weak, np.asarray(first) + np.asarray(c_strong))


def ascending(score: np.ndarray) -> np.ndarray:
    """Lowest score moved first; ties in input order."""
    return np.argsort(np.asarray(score, dtype=np.float64), kind="stable")


def apgr(pct_strong: np.ndarray, quality: np.ndarray, q_weak: float, q_strong: float) -> float:
    """Average performance gap recovered: ∫₀¹ (quality − q_weak) / (q_strong − q_weak) d(share on strong)."""
    gap = q_strong - q_weak
    if gap <= 0:
        return 1.0  # the weak tier is already as good: nothing to recover
    pgr = (np.asarray(quality) - q_weak) / gap
    x = np.asarray(pct_strong)
    return float(np.sum((pgr[1:] + pgr[:-1]) / 2 * np.diff(x)))


def quality_at(curve: Curve, cost: np.ndarray | float) -> np.ndarray:
    """The best quality the policy reaches within `cost` (mixing two thresholds interpolates linearly)."""
    by_cost = np.argsort(curve.cost, kind="stable")
    c, q = curve.cost[by_cost], np.maximum.accumulate(curve.quality[by_cost])
    return np.interp(cost, c, q, left=np.nan)


def apgr_by_cost(curve: Curve, c_weak: float, c_strong: float, q_weak: float, q_strong: float) -> float:
    """APGR over cost from always-weak's to always-strong's (random mixing 0.5)."""
    if q_strong <= q_weak or c_strong <= c_weak:
        return 1.0
    x = np.linspace(0.0, 1.0, 201)
    q = np.nan_to_num(quality_at(curve, c_weak + x * (c_strong - c_weak)), nan=q_weak)
    return apgr(x, q, q_weak, q_strong)


def random_quality(cost: np.ndarray, c_weak: float, c_strong: float, q_weak: float, q_strong: float) -> np.ndarray:
    """Random mixing: sending a share p to the strong tier costs and earns p of the way between the two."""
    p = np.clip((np.asarray(cost) - c_weak) / (c_strong - c_weak), 0.0, 1.0) if c_strong != c_weak else 0.0
    return q_weak + p * (q_strong - q_weak)


@dataclass
class PairEval:
    """Every policy of one pair on one measure."""

    curves: dict[str, Curve]  # router, cascade, lookahead, oracle (and tie_stop where measured)
    c_weak: float
    c_strong: float
    q_weak: float
    q_strong: float

    def saving(self, name: str) -> float | None:
        """1 − cost / always-strong's cost where `name` first reaches QUALITY_TARGET × strong's quality."""
        if name != "random":
            return saving_at_target(self.curves[name], self.c_strong, self.q_strong)
        target = QUALITY_TARGET * self.q_strong
        share = 0.0 if self.q_weak >= target else (target - self.q_weak) / (self.q_strong - self.q_weak)
        return 1.0 - (self.c_weak + share * (self.c_strong - self.c_weak)) / self.c_strong

    def below_random(self, name: str, tolerance: float = 1e-9) -> tuple[int, int, float]:
        """Points of `name`'s sweep (up to always-strong's cost) below random mixing: (count, of, worst margin)."""
        curve = self.curves[name]
        within = curve.cost <= self.c_strong + 1e-12
        margin = curve.quality[within] - random_quality(curve.cost[within], self.c_weak, self.c_strong,
                                                        self.q_weak, self.q_strong)
        return int(np.sum(margin < -tolerance)), int(within.sum()), float(margin.min())


def evaluate_pair(q_weak: np.ndarray, q_strong: np.ndarray, c_weak: np.ndarray, c_strong: np.ndarray, *,
                  predicted_gain: np.ndarray, confidence: np.ndarray, lookahead_confidence: np.ndarray | None = None,
                  c_lookahead: np.ndarray | None = None) -> PairEval:
    """All policies on one pair; `confidence` is −∞ for answers a cascade always retries (empty ones)."""
    curves = {
        "router": routing_curve(ascending(-np.asarray(predicted_gain)), q_weak, q_strong, c_weak, c_strong),
        "cascade": cascade_curve(ascending(confidence), q_weak, q_strong, c_weak, c_strong),
        "oracle": routing_curve(ascending(-(np.asarray(q_strong) - np.asarray(q_weak))), q_weak, q_strong, c_weak,
                                c_strong),
    }
    if lookahead_confidence is not None:
        curves["lookahead"] = cascade_curve(ascending(lookahead_confidence), q_weak, q_strong, c_weak, c_strong,
                                            c_lookahead)
    return PairEval(curves, float(np.mean(c_weak)), float(np.mean(c_strong)), float(np.mean(q_weak)),
                    float(np.mean(q_strong)))
