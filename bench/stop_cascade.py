"""The cascades of bench/router.py that stop the cheap tier's answer while it is made, at a token its own
top-2 margin marks, and retry on the strong tier: what each stop costs and where it happens.

Why margins: `mid` is `full` quantized, so their greedy answers are the same until a token where the two
most likely next tokens are close enough for int8's error to swap them; how much of the answer comes after
that token is what fidelity loses. A stream can be stopped there, paying for the prompt and the tokens made.

- near tie: stop at the first token whose margin is below a threshold that falls by `slope` nats per token
  (a late near tie costs less of the answer);
- divergence risk: stop where the summed risk of having parted passes a threshold: per token, the rate at
  which answers parted at tokens of that margin on the training answers (`divergence_hazard`), weighted by
  the share of the answer still to come to a power.

Slope and power are chosen on the training answers (the most saved at QUALITY_TARGET); the threshold is what
the benchmark sweeps (bench/cost_quality.py's `stop_curve`). For the gateway, `fit_risk_stop` also chooses the
divergence risk's threshold on the training answers (the cheapest point of their sweep that keeps QUALITY_TARGET of
the strong tier's quality, the target the power is chosen at) and returns the artifact's stop
(tiers/divergence.py's `DivergenceStop`): the risk's arithmetic is that module's, so the benchmark measures what
the gateway runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.cost_quality import QUALITY_TARGET, PairEval, first_reaching, stop_curve
from tiers.divergence import HAZARD_EDGES, DivergenceStop, cumulative_risk

TIE_SLOPES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)  # nats per token the near-tie threshold falls by
RISK_POWERS = (0.0, 1.0, 2.0, 3.0)  # the powers of the share still to come that weigh the divergence hazard


def tie_gaps(answers: Sequence[Any], tier: Any, slope: float, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Per answer and token: how far its margin (nats between its two most likely tokens) is above a near tie,
    counting a later token's slack (margin + slope x position), and what the answer cost stopped there.

    Returns gap [N, T] (+inf past an answer's end or where a token came without two alternatives: no stop
    there; -inf at token 0 for an answer without text or log-probabilities, which a cascade always retries)
    and cost [N, T] (the tier's price for the prompt and tokens 0..t)."""
    def gaps(a: Any, width: int) -> np.ndarray:
        return np.array([top[0] - top[1] + slope * t if len(top) >= 2 else np.inf
                         for t, (_, top) in enumerate(a.logprobs[:width])])

    return _stop_gaps(answers, tier, max_tokens, gaps)


def _stop_gaps(answers: Sequence[Any], tier: Any, max_tokens: int,
               gaps: Callable[[Any, int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """gap [N, T] and cost [N, T] as tie_gaps says, an answer's gaps from `gaps(answer, T)` (one per token it has)."""
    n, width = len(answers), max(max_tokens, 1)
    gap = np.full((n, width), np.inf)
    cost = np.zeros((n, width))
    for i, a in enumerate(answers):
        cost[i] = [float(tier.price(a.num_prompt_tokens, min(t + 1, max(len(a.token_ids), 1)))) for t in range(width)]
        if not a.text.strip() or not a.logprobs:
            gap[i, 0] = -np.inf
            continue
        row = gaps(a, width)
        gap[i, :len(row)] = row
    return gap, cost


def tie_thresholds(gap: np.ndarray) -> np.ndarray:
    """Every threshold at which some answer's stop moves (just above each running minimum of its gaps),
    ascending: the sweep then has a point wherever the policy changes."""
    finite = np.where(np.isfinite(gap), gap, np.nan)
    records = np.fmin.accumulate(finite, axis=1)
    values = np.unique(records[np.isfinite(records)])
    return values + 1e-9


def fit_tie_slope(trained: Any, weak: str, strong: str, catalogue: Any, max_tokens: int) -> float:
    """The slope of TIE_SLOPES that saves most at QUALITY_TARGET on the training answers (ties: the smaller)."""
    return _best_setting(TIE_SLOPES, lambda slope: tie_gaps(trained.answers[weak], catalogue.tiers[weak], slope,
                                                           max_tokens), trained, weak, strong, catalogue)


def _best_setting(grid: Sequence[float], gaps_of: Callable[[float], tuple[np.ndarray, np.ndarray]], trained: Any,
                  weak: str, strong: str, catalogue: Any) -> float:
    """The setting of `grid` whose stops (`gaps_of(setting)`: gap, cost) save most at QUALITY_TARGET on the training
    answers (ties: the first)."""
    q_weak = trained.fidelity[weak]
    q_strong = trained.fidelity.get(strong, np.ones(len(q_weak)))
    cost = {t: np.array([float(catalogue.tiers[t].price(a.num_prompt_tokens, len(a.token_ids)))
                         for a in trained.answers[t]]) for t in (weak, strong)}
    best, best_saving = grid[0], -np.inf
    for setting in grid:
        gap, c_upto = gaps_of(setting)
        curve = stop_curve(gap, tie_thresholds(gap), q_weak, q_strong, cost[weak], cost[strong], c_upto)
        saving = PairEval({"stop": curve}, float(cost[weak].mean()), float(cost[strong].mean()),
                          float(q_weak.mean()), float(q_strong.mean())).saving("stop")
        if saving is not None and saving > best_saving + 1e-12:
            best, best_saving = setting, saving
    return best


def divergence_hazard(weak: Sequence[Any], strong: Sequence[Any]) -> np.ndarray:
    """Per HAZARD_EDGES margin bin: the share of weak's tokens, while its greedy answer still equals strong's,
    at which the two parted (a Laplace-smoothed rate), from pairs of answers to the same prompts."""
    edges = np.asarray(HAZARD_EDGES)
    parted, seen = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    for a, b in zip(weak, strong, strict=True):
        for t, (_, top) in enumerate((a.logprobs or [])[:min(len(a.token_ids), len(b.token_ids))]):
            if len(top) < 2:
                break
            k = int(np.searchsorted(edges, top[0] - top[1], side="right")) - 1
            seen[k] += 1
            if a.token_ids[t] != b.token_ids[t]:
                parted[k] += 1
                break
    return (parted + 0.1) / (seen + 1.0)


def risk_gaps(answers: Sequence[Any], tier: Any, hazard: np.ndarray, power: float,
              max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """tie_gaps' shapes for the divergence risk: gap [N, T] = −(the risk so far, tiers/divergence.py's
    `cumulative_risk`, what the gateway sums), which falls token by token, so stop_curve stops an answer at the
    first token where its risk passes the threshold (the gateway's threshold is −that gap threshold)."""
    stop = risk_stop(hazard, power, max_tokens, np.inf)

    def gaps(a: Any, width: int) -> np.ndarray:
        return -np.asarray(cumulative_risk((top for _, top in a.logprobs[:width]), stop))

    return _stop_gaps(answers, tier, max_tokens, gaps)


def risk_stop(hazard: np.ndarray, power: float, width: int, threshold: float, cheap: str = "weak",
              strong: str = "strong", quality: float = 1.0) -> DivergenceStop:
    """The stop of these settings (HAZARD_EDGES' bins), kept for plan floors up to `quality`."""
    return DivergenceStop(cheap, strong, tuple(float(e) for e in HAZARD_EDGES), tuple(float(h) for h in hazard),
                          float(power), max(int(width), 1), float(threshold), float(quality))


def fit_risk(trained: Any, weak: str, strong: str, catalogue: Any, max_tokens: int) -> tuple[np.ndarray, float]:
    """The hazard and the power of RISK_POWERS that saves most at QUALITY_TARGET on the training answers."""
    hazard = divergence_hazard(trained.answers[weak], trained.answers[strong])
    return hazard, _best_setting(RISK_POWERS, lambda power: risk_gaps(trained.answers[weak], catalogue.tiers[weak],
                                                                       hazard, power, max_tokens),
                                 trained, weak, strong, catalogue)


def fit_risk_stop(trained: Any, weak: str, strong: str, catalogue: Any,
                  max_tokens: int) -> tuple[np.ndarray, float, DivergenceStop | None, dict[str, float]]:
    """The artifact's stop for weak → strong, all chosen on the training answers: the hazard and power of `fit_risk`,
    and the threshold of the first point of their sweep (fewest stops first) whose quality reaches QUALITY_TARGET
    of strong's (`first_reaching`; a point, not a mix of two: the gateway runs one threshold). None where weak
    keeps the target unstopped (nothing to stop) or no threshold reaches it; with what the training answers gave
    at the threshold (share stopped, quality, saving against always-strong); first the hazard and power."""
    hazard, power = fit_risk(trained, weak, strong, catalogue, max_tokens)
    q_weak = trained.fidelity[weak]
    q_strong = trained.fidelity.get(strong, np.ones(len(q_weak)))
    cost = {t: np.array([float(catalogue.tiers[t].price(a.num_prompt_tokens, len(a.token_ids)))
                         for a in trained.answers[t]]) for t in (weak, strong)}
    gap, c_upto = risk_gaps(trained.answers[weak], catalogue.tiers[weak], hazard, power, max_tokens)
    thresholds = tie_thresholds(gap)
    curve = stop_curve(gap, thresholds, q_weak, q_strong, cost[weak], cost[strong], c_upto)
    target = QUALITY_TARGET * float(np.mean(q_strong))  # the mean fidelity the stop keeps: plans' floors up to it
    i = first_reaching(curve, target)
    fit = {"power": float(power), "points": float(len(thresholds))}
    if i is None or i == 0:
        return hazard, power, None, fit
    threshold = max(-float(thresholds[i - 1]), 0.0)  # stop_curve's point i is thresholds[i - 1]
    fit |= {"stopped": float(curve.pct_strong[i]), "quality": float(curve.quality[i]),
            "saving": 1.0 - float(curve.cost[i]) / float(np.mean(cost[strong]))}
    return hazard, power, risk_stop(hazard, power, max_tokens, threshold, weak, strong, target), fit
