"""bench/stop_cascade.py's `fit_risk_stop`: the threshold the artifact stores is chosen on the training answers at
QUALITY_TARGET, and the gateway's risk (tiers/divergence.py) stops the same answers at it as the benchmark's sweep."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.cost_quality import QUALITY_TARGET
from bench.stop_cascade import fit_risk_stop
from tiers.divergence import DivergenceRisk, DivergenceStop


class Price:
    def __init__(self, per_token: float) -> None:
        self.per_token = per_token

    def price(self, prompt: int, output: int) -> float:
        return self.per_token * (prompt + output)


def answer(margins: list[float], ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(text="an answer", token_ids=ids, num_prompt_tokens=20, finish_reason="stop",
                           logprobs=[(-0.1, [-0.1, -0.1 - m, -8.0]) for m in margins])


def trained_set() -> SimpleNamespace:
    """Twelve prompts: six where mid parts from full at an early near tie (fidelity 0.5), six sure all along
    (fidelity 1.0); the near ties come at different tokens, so the sweep has several points."""
    weak, strong, fidelity = [], [], []
    for i in range(12):
        n = 12
        if i % 2:
            margins = [2.5] * n
            ids = list(range(n))
            weak.append(answer(margins, ids))
            strong.append(answer(margins, ids))
            fidelity.append(1.0)
        else:
            at = 1 + i // 2  # the near tie, and the parting, at token 1..6
            margins = [2.5] * at + [0.01] + [0.4] * (n - at - 1)
            ids = list(range(n))
            weak.append(answer(margins, ids))
            strong.append(answer(margins, [*ids[:at], 99, *ids[at + 1:]]))
            fidelity.append(0.5)
    return SimpleNamespace(answers={"mid": weak, "full": strong}, fidelity={"mid": np.array(fidelity)})



def stopped_by(stop: DivergenceStop, answers: Sequence[Any]) -> list[bool]:
    """Per answer: whether the gateway's risk (tiers/divergence.py, fed token by token as the meter feeds it) passes
    the stop's threshold within it."""
    out = []
    for a in answers:
        risk = DivergenceRisk(stop)
        for _, top in a.logprobs:
            risk.add(top)
        out.append(risk.passed)
    return out

def test_the_stored_threshold_keeps_the_target_on_the_training_answers_and_the_gateway_stops_the_same_answers() -> None:
    trained = trained_set()
    catalogue = SimpleNamespace(tiers={"mid": Price(0.001), "full": Price(0.003)})
    _, power, stop, fit = fit_risk_stop(trained, "mid", "full", catalogue, 16)
    assert stop is not None and (stop.cheap, stop.strong, stop.width, stop.power) == ("mid", "full", 16, power)
    assert fit["quality"] >= QUALITY_TARGET - 1e-12 and 0 < fit["stopped"] < 1
    stopped = stopped_by(stop, trained.answers["mid"])
    assert np.mean(stopped) == fit["stopped"]  # the gateway's "passes" is the sweep's point, not one off
    quality = np.where(stopped, 1.0, trained.fidelity["mid"]).mean()
    assert quality == fit["quality"]
    # the first point that reaches the target: a threshold a little above it stops fewer and misses the target
    higher = replace(stop, threshold=stop.threshold + 1e-6)
    fewer = stopped_by(higher, trained.answers["mid"])
    assert np.where(fewer, 1.0, trained.fidelity["mid"]).mean() < QUALITY_TARGET


def test_no_stop_where_the_cheap_tier_keeps_the_target_unstopped() -> None:
    trained = trained_set()
    trained.fidelity["mid"] = np.full(12, 0.99)
    catalogue = SimpleNamespace(tiers={"mid": Price(0.001), "full": Price(0.003)})
    *_, stop, fit = fit_risk_stop(trained, "mid", "full", catalogue, 16)
    assert stop is None and "stopped" not in fit and "saving" not in fit
