"""Fitting the cascade's stop at a divergence risk (tiers/divergence.py's `DivergenceStop`) on training answers.

Why a stop: `mid` is `full` quantized, so their greedy answers are the same until a token where the two most likely
next tokens are close enough for int8's error to swap them; how much of the answer comes after that token is what
fidelity loses. An answer can be stopped there, paying for its prompt and the tokens made, and retried on the
strong tier. The divergence risk sums, per token, the rate at which answers parted at tokens of that margin on the
training answers (`divergence_hazard`), weighted by the share of the answer still to come to a power.

From one pair's training answers (every tier's answers to the same prompts, with their top log-probabilities, and
each cheap tier's fidelity to the reference), `fit_risk_stop` chooses:

1. the hazard per HAZARD_EDGES margin bin, from the pairs of cheap and strong answers;
2. the power of RISK_POWERS whose stops save most at QUALITY_TARGET of strong's quality (`best_setting`);
3. the threshold: the first point of that power's sweep (fewest stops first) whose mean quality reaches
   QUALITY_TARGET x strong's mean fidelity (`first_reaching`; one point, not a mix of two: the gateway runs one
   threshold). None where the cheap tier keeps the target unstopped or no threshold reaches it.

The sweep (`stop_curve`) is the benchmark's: one point per threshold at which some answer's stop moves, each
point's cost the cheap tier's price up to the token it stopped at plus the strong tier's, or the cheap answer's
whole price where it stands. `tiergate router train` (training/router_training.py) stores the stops it fits in the
artifact; bench/stop_cascade.py and bench/cost_quality.py import this module, so the benchmark measures the stop
the product fits, and the risk's arithmetic is tiers/divergence.py's, so the gateway applies the threshold fitted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

import numpy as np

from tiers.divergence import HAZARD_EDGES, DivergenceStop, cumulative_risk

QUALITY_TARGET = 0.95  # of the strong tier's quality
RISK_POWERS = (0.0, 1.0, 2.0, 3.0)  # the powers of the share still to come that weigh the divergence hazard


class Priced(Protocol):
    def price(self, input_tokens: int, output_tokens: int, /) -> Decimal | float: ...


class Prices(Protocol):
    """What the fit reads of the tier catalogue (tiers/catalogue.py's `TierCatalogue`)."""

    @property
    def tiers(self) -> Mapping[str, Priced]: ...


class TrainingAnswers(Protocol):
    """What the fit reads of the training answers (training/router_training.py's `Collected`)."""

    answers: dict[str, list[Any]]  # tier → its answer (training/tier_answers.py's `Answer`) per prompt
    fidelity: dict[str, np.ndarray]  # cheaper tier → fidelity to the reference per prompt (the reference: 1.0)


@dataclass
class Curve:
    """One policy swept from nothing moved to strong to everything moved (N + 1 points, in sweep order)."""

    pct_strong: np.ndarray  # share of requests answered by the strong tier
    cost: np.ndarray  # mean cost per request
    quality: np.ndarray  # mean quality


def stop_curve(gap: np.ndarray, thresholds: np.ndarray, q_weak: np.ndarray, q_strong: np.ndarray,
               c_weak: np.ndarray, c_strong: np.ndarray, c_upto: np.ndarray) -> Curve:
    """A cascade that stops weak's answer at its first token whose `gap` is below the threshold and retries on
    strong; one point per threshold (ascending), after the all-on-weak point. The retried set and what each
    retried attempt cost both change with the threshold, so this is not a policy over one order.

    gap: [N, T] per token (+inf past an answer's end: never stops there); c_upto: [N, T] what weak's attempt
    costs when stopped at token t (its prompt and tokens 0..t)."""
    gap = np.asarray(gap, dtype=np.float64)
    n = len(gap)
    qw, qs, cw, cs = (np.asarray(a, dtype=np.float64) for a in (q_weak, q_strong, c_weak, c_strong))
    share, cost, quality = [0.0], [float(cw.mean())], [float(qw.mean())]
    rows = np.arange(n)
    for threshold in np.asarray(thresholds, dtype=np.float64):
        hit = gap < threshold  # [N, T]
        stopped = hit.any(axis=1)
        first = np.asarray(c_upto)[rows, hit.argmax(axis=1)]
        share.append(float(stopped.mean()))
        cost.append(float(np.where(stopped, first + cs, cw).mean()))
        quality.append(float(np.where(stopped, qs, qw).mean()))
    return Curve(np.array(share), np.array(cost), np.array(quality))


def cost_at_quality(curve: Curve, target: float) -> float | None:
    """The lowest cost at which the curve reaches `target` quality (linear between points), or None."""
    q, c = curve.quality, curve.cost
    hits = np.nonzero(q >= target - 1e-12)[0]
    if len(hits) == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(c[0])
    t = (target - q[i - 1]) / (q[i] - q[i - 1])
    return float(c[i - 1] + t * (c[i] - c[i - 1]))


def first_reaching(curve: Curve, target: float) -> int | None:
    """The first point of the curve's sweep whose quality reaches `target` (what `cost_at_quality` interpolates
    towards), or None: the setting to deploy where one setting must be chosen."""
    hits = np.nonzero(curve.quality >= target - 1e-12)[0]
    return int(hits[0]) if len(hits) else None


def saving_at_target(curve: Curve, c_strong: float, q_strong: float) -> float | None:
    """1 − cost / always-strong's cost (`c_strong`, a mean) where the curve first reaches QUALITY_TARGET × strong's
    mean quality, or None where it never does or always-strong costs nothing (nothing to save)."""
    found = cost_at_quality(curve, QUALITY_TARGET * q_strong)
    return None if found is None or c_strong <= 0 else 1.0 - found / c_strong


def stop_gaps(answers: Sequence[Any], tier: Priced, max_tokens: int,
              gaps: Callable[[Any, int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per answer and token: how far it is from being stopped (`gaps(answer, T)`, one per token it has) and what the
    answer cost stopped there.

    Returns gap [N, T] (+inf past an answer's end: no stop there; -inf at token 0 for an answer without text or
    log-probabilities, which a cascade always retries) and cost [N, T] (the tier's price for the prompt and
    tokens 0..t)."""
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


def _whole_costs(trained: TrainingAnswers, catalogue: Prices, tiers: Sequence[str]) -> dict[str, np.ndarray]:
    """Per tier: what each of its whole answers cost (its prompt and every token it made)."""
    return {t: np.array([float(catalogue.tiers[t].price(a.num_prompt_tokens, len(a.token_ids)))
                         for a in trained.answers[t]]) for t in tiers}


def _qualities(trained: TrainingAnswers, weak: str, strong: str) -> tuple[np.ndarray, np.ndarray]:
    q_weak = trained.fidelity[weak]
    return q_weak, trained.fidelity.get(strong, np.ones(len(q_weak)))


def best_setting(grid: Sequence[float], gaps_of: Callable[[float], tuple[np.ndarray, np.ndarray]],
                 trained: TrainingAnswers, weak: str, strong: str, catalogue: Prices) -> float:
    """The setting of `grid` whose stops (`gaps_of(setting)`: gap, cost) save most at QUALITY_TARGET on the training
    answers (ties: the first)."""
    q_weak, q_strong = _qualities(trained, weak, strong)
    cost = _whole_costs(trained, catalogue, (weak, strong))
    best, best_saving = grid[0], -np.inf
    for setting in grid:
        gap, c_upto = gaps_of(setting)
        curve = stop_curve(gap, tie_thresholds(gap), q_weak, q_strong, cost[weak], cost[strong], c_upto)
        saving = saving_at_target(curve, float(cost[strong].mean()), float(q_strong.mean()))
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


def risk_gaps(answers: Sequence[Any], tier: Priced, hazard: np.ndarray, power: float,
              max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """`stop_gaps`' shapes for the divergence risk: gap [N, T] = −(the risk so far, tiers/divergence.py's
    `cumulative_risk`, what the gateway sums), which falls token by token, so stop_curve stops an answer at the
    first token where its risk passes the threshold (the gateway's threshold is −that gap threshold)."""
    stop = risk_stop(hazard, power, max_tokens, np.inf)

    def gaps(a: Any, width: int) -> np.ndarray:
        return -np.asarray(cumulative_risk((top for _, top in a.logprobs[:width]), stop))

    return stop_gaps(answers, tier, max_tokens, gaps)


def risk_stop(hazard: np.ndarray, power: float, width: int, threshold: float, cheap: str = "weak",
              strong: str = "strong", quality: float = 1.0) -> DivergenceStop:
    """The stop of these settings (HAZARD_EDGES' bins), kept for plan floors up to `quality`."""
    return DivergenceStop(cheap, strong, tuple(float(e) for e in HAZARD_EDGES), tuple(float(h) for h in hazard),
                          float(power), max(int(width), 1), float(threshold), float(quality))


def fit_risk(trained: TrainingAnswers, weak: str, strong: str, catalogue: Prices,
             max_tokens: int) -> tuple[np.ndarray, float]:
    """The hazard and the power of RISK_POWERS that saves most at QUALITY_TARGET on the training answers."""
    hazard = divergence_hazard(trained.answers[weak], trained.answers[strong])
    return hazard, best_setting(RISK_POWERS, lambda power: risk_gaps(trained.answers[weak], catalogue.tiers[weak],
                                                                      hazard, power, max_tokens),
                                trained, weak, strong, catalogue)


def fit_risk_stop(trained: TrainingAnswers, weak: str, strong: str, catalogue: Prices,
                  max_tokens: int) -> tuple[np.ndarray, float, DivergenceStop | None, dict[str, float]]:
    """The artifact's stop for weak → strong, all chosen on the training answers: the hazard and power of `fit_risk`,
    and the threshold of the first point of their sweep (fewest stops first) whose quality reaches QUALITY_TARGET
    of strong's (`first_reaching`; a point, not a mix of two: the gateway runs one threshold). None where weak
    keeps the target unstopped (nothing to stop), no threshold reaches it, or strong's answers cost nothing (a
    catalogue's free tier: nothing to save); with what the training answers gave
    at the threshold (share stopped, quality, saving against always-strong); first the hazard and power."""
    hazard, power = fit_risk(trained, weak, strong, catalogue, max_tokens)
    q_weak, q_strong = _qualities(trained, weak, strong)
    cost = _whole_costs(trained, catalogue, (weak, strong))
    gap, c_upto = risk_gaps(trained.answers[weak], catalogue.tiers[weak], hazard, power, max_tokens)
    thresholds = tie_thresholds(gap)
    curve = stop_curve(gap, thresholds, q_weak, q_strong, cost[weak], cost[strong], c_upto)
    target = QUALITY_TARGET * float(np.mean(q_strong))  # the mean fidelity the stop keeps: plans' floors up to it
    i = first_reaching(curve, target)
    fit = {"power": float(power), "points": float(len(thresholds))}
    if i is None or i == 0 or float(np.mean(cost[strong])) <= 0:
        return hazard, power, None, fit
    threshold = max(-float(thresholds[i - 1]), 0.0)  # stop_curve's point i is thresholds[i - 1]
    fit |= {"stopped": float(curve.pct_strong[i]), "quality": float(curve.quality[i]),
            "saving": 1.0 - float(curve.cost[i]) / float(np.mean(cost[strong]))}
    return hazard, power, risk_stop(hazard, power, max_tokens, threshold, weak, strong, target), fit


def fit_stops(trained: TrainingAnswers, pairs: Sequence[tuple[str, str]], catalogue: Prices,
              max_tokens: int) -> tuple[dict[str, DivergenceStop], dict[str, dict[str, float]]]:
    """`fit_risk_stop` for every pair (cheap, strong): the stops found, keyed "cheap->strong" as the artifact's
    `cascade.stops`, and per pair what the fit gave on the training answers (power, sweep points, and where a stop
    was found: the share it stopped, the quality it kept, its saving against always-strong). A stop that saved
    nothing on the training answers (retrying costs more than the cheap answers it keeps save) is recorded, not
    kept: the gateway then judges the pair by its per-floor thresholds."""
    stops, record = {}, {}
    for weak, strong in pairs:
        *_, stop, fit = fit_risk_stop(trained, weak, strong, catalogue, max_tokens)
        key = f"{weak}->{strong}"
        record[key] = fit
        if stop is not None and fit["saving"] > 0:
            stops[key] = stop
    return stops, record
