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

Slope and power are chosen on the training answers (the most saved at QUALITY_TARGET); the threshold is what the
benchmark sweeps (`stop_curve`). For the gateway, `fit_risk_stop` also chooses the divergence risk's threshold on
the training answers (the first point of their sweep, fewest stops first, that keeps QUALITY_TARGET of the strong
tier's quality, the target the power is chosen at) and returns the artifact's stop (tiers/divergence.py's
`DivergenceStop`).

The divergence risk's fit is the product's (training/divergence_fit.py, which `tiergate router train` stores in the
artifact), imported from there with the sweep it shares with the near tie; the risk's arithmetic is
tiers/divergence.py's, so the benchmark measures what the product fits and the gateway runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from training.divergence_fit import RISK_POWERS as RISK_POWERS
from training.divergence_fit import best_setting, stop_gaps
from training.divergence_fit import divergence_hazard as divergence_hazard
from training.divergence_fit import fit_risk as fit_risk
from training.divergence_fit import fit_risk_stop as fit_risk_stop
from training.divergence_fit import risk_gaps as risk_gaps
from training.divergence_fit import risk_stop as risk_stop
from training.divergence_fit import tie_thresholds as tie_thresholds

TIE_SLOPES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)  # nats per token the near-tie threshold falls by


def tie_gaps(answers: Sequence[Any], tier: Any, slope: float, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Per answer and token: how far its margin (nats between its two most likely tokens) is above a near tie,
    counting a later token's slack (margin + slope x position), and what the answer cost stopped there.

    Returns gap [N, T] (+inf past an answer's end or where a token came without two alternatives: no stop
    there; -inf at token 0 for an answer without text or log-probabilities, which a cascade always retries)
    and cost [N, T] (the tier's price for the prompt and tokens 0..t)."""
    def gaps(a: Any, width: int) -> np.ndarray:
        return np.array([top[0] - top[1] + slope * t if len(top) >= 2 else np.inf
                         for t, (_, top) in enumerate(a.logprobs[:width])])

    return stop_gaps(answers, tier, max_tokens, gaps)


def fit_tie_slope(trained: Any, weak: str, strong: str, catalogue: Any, max_tokens: int) -> float:
    """The slope of TIE_SLOPES that saves most at QUALITY_TARGET on the training answers (ties: the smaller)."""
    return best_setting(TIE_SLOPES, lambda slope: tie_gaps(trained.answers[weak], catalogue.tiers[weak], slope,
                                                          max_tokens), trained, weak, strong, catalogue)
