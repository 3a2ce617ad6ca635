"""The meter's divergence risk (a `Reading` with a stop): summed token by token from the tier's chunks, the early
judgement due at the first token where it passes the threshold, and nothing added after it."""

from __future__ import annotations

import time

from gateway.pipeline.meter import Meter, Reading
from tiers.divergence import HAZARD_EDGES, DivergenceRisk, DivergenceStop

STOP = DivergenceStop("mid", "full", HAZARD_EDGES, (0.3,) + (0.0,) * (len(HAZARD_EDGES) - 2), 0.0, 48, 0.5, 0.95)


def token(margin: float) -> dict:
    return {"token": "x", "logprob": -0.1, "top_logprobs": [{"logprob": -0.1}, {"logprob": -0.1 - margin}]}


def chunk(*margins: float) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": "x" * len(margins)},
                         "logprobs": {"content": [token(m) for m in margins]}}]}


def test_the_judgement_is_due_at_the_token_where_the_risk_passes() -> None:
    meter = Meter(time.perf_counter(), reading=Reading(5, stop=STOP))
    meter.add(chunk(3.0))  # a sure token: rate 0
    meter.add(chunk(0.01))  # 0.3
    assert not meter.past_lookahead
    meter.add(chunk(3.0, 0.01, 0.01))  # 0.6 at the answer's 4th token; the 5th is not added
    risk = meter.first
    assert meter.past_lookahead and isinstance(risk, DivergenceRisk) and risk is meter.risk
    assert risk.passed_at == 4 and risk.value == 0.6 and risk.num_tokens == 4
    assert meter.signals is not None and meter.signals.num_tokens == 5  # the whole answer's signals go on


def test_without_a_stop_the_look_ahead_is_what_it_was() -> None:
    meter = Meter(time.perf_counter(), reading=Reading(5, lookahead=2))
    meter.add(chunk(0.01, 0.01))
    assert meter.risk is None and not meter.past_lookahead
    meter.add(chunk(0.01))
    assert meter.past_lookahead and meter.first is not None and meter.first.num_tokens == 2
