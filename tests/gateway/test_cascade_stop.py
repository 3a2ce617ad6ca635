"""The cascade's stop at a divergence risk end to end (tiers/divergence.py): a non-streamed cheap answer whose risk
passes the artifact's threshold at token k is not read further, billed for its prompt and k tokens, and answered by
the dearer tier; one under it stands; a stream keeps the look-ahead.

`small` is our engine's server over a scripted runner: every token comes with alternatives (-0.25, -1.5), a margin
of 1.25 nats, so with that bin's rate at 0.1 (every other bin's 0, the last one's too: a token without two
alternatives adds nothing) and power 0 the risk is 0.1 a token."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cascade_logprobs import (  # noqa: F401 (fixtures)
    ReadsAlternatives,
    engine_small,
    settings,
    stream_chat,
    with_calibrated_model,
)
from tests.gateway.test_routing_api import chat
from tests.stubs import REPLY, StubState
from tiers.divergence import HAZARD_EDGES, DivergenceStop


class Stops(ReadsAlternatives):
    """A look-ahead of 2 tokens that every answer of the scripted runner passes (its confidence 0.87 keeps floor
    0.8), and a stop for small -> mid at `threshold` (0.1 of risk a token), fitted to keep a mean quality of
    `quality`."""

    def __init__(self, threshold: float, quality: float = 0.95) -> None:
        super().__init__(0.4, lookahead=2)
        hazard = tuple(0.1 if lo <= 1.25 < hi else 0.0 for lo, hi in pairwise(HAZARD_EDGES))
        self.cascade.stops = {"small->mid": DivergenceStop("small", "mid", HAZARD_EDGES, hazard, 0.0, 48, threshold,
                                                             quality)}


@contextlib.contextmanager
def stopping(settings: tuple[Settings, StubState], tmp_path: Path, threshold: float,  # noqa: F811
             plan: str = "checked", quality: float = 0.95) -> Iterator[Gateway]:
    with running_gateway(settings[0], settings[1], plan=plan) as gw:
        with_calibrated_model(gw, tmp_path, Stops(threshold, quality))
        yield gw


def test_an_answer_whose_risk_passes_the_threshold_is_stopped_there_and_answered_by_the_dearer_tier(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with stopping(settings, tmp_path, 0.25) as gw:  # 0.1, 0.2, 0.3: passed at token 3
        r = chat(gw, "anything", max_tokens=64)
        assert r.status_code == 200 and r.headers["x-tiergate-cascade"] == "small->mid", r.text
        assert r.json()["choices"][0]["message"]["content"] == REPLY
        assert "cascade from small (divergence risk 0.30 > 0.25 at token 3)" in r.headers["x-tiergate-route-reason"]
        rows = gw.ledger_rows()
        first = next(row for row in rows if row.tier == "small")
        second = next(row for row in rows if row.tier == "mid")
        assert "divergence risk 0.30 > 0.25 at token 3: cascaded to mid" in first.route_reason, first.route_reason
        # not read further: billed for its prompt and the 3 tokens made, not the whole answer's 8
        assert first.finish_reason == "cascaded" and first.output_tokens == 3 and first.input_tokens > 0, first
        assert second.cascade_of == first.request_id and second.output_tokens > 0 and len(rows) == 2
        assert first.price_usd > 0 and second.price_usd > 0
        # the look-ahead (which this answer passes) did not judge it: the stop did
        assert "on its first 2 tokens" not in first.route_reason
        assert r.json()["usage"]["completion_tokens"] == second.output_tokens  # the client's answer is mid's


def test_an_answer_under_the_threshold_stands_on_it(settings: tuple[Settings, StubState],  # noqa: F811
                                                   tmp_path: Path) -> None:
    with stopping(settings, tmp_path, 5.0) as gw:
        r = chat(gw, "anything", max_tokens=64)
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small", r.text
        assert "x-tiergate-cascade" not in r.headers and r.json()["choices"][0]["message"]["content"] == "unsure."
        assert r.headers["x-tiergate-route-reason"].endswith("; divergence risk 0.80 within 5.00 over 8 tokens")
        row = gw.ledger_rows()[0]
        assert not settings[1].requests and row.finish_reason == "stop" and row.output_tokens == 8


def test_a_stream_keeps_the_look_ahead(settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    """The same artifact would stop the answer at token 3; a stream's tokens cannot be taken back, so it is judged
    by the look-ahead (which it passes) and sent whole."""
    with stopping(settings, tmp_path, 0.25, plan="streamed") as gw:
        status, headers, text = stream_chat(gw)
        assert status == 200 and text == "unsure." and "x-tiergate-cascade" not in headers
        assert headers["x-tiergate-route-reason"].endswith("; calibrated confidence 0.87 on its first 2 tokens keeps "
                                                           "floor 0.8")
        assert not settings[1].requests and gw.ledger_rows()[0].output_tokens == 8


def test_a_floor_above_the_quality_the_stop_keeps_is_judged_by_the_per_floor_thresholds(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    """The stop keeps a mean quality (0.7 here) fitted once; a plan whose floor (0.8) asks more is judged by the
    look-ahead's thresholds for its floor, which this answer passes, though the stop would have cut it at token 3."""
    with stopping(settings, tmp_path, 0.25, quality=0.7) as gw:
        r = chat(gw, "anything", max_tokens=64)
        assert r.status_code == 200 and "x-tiergate-cascade" not in r.headers, r.text
        assert r.headers["x-tiergate-route-reason"].endswith("; calibrated confidence 0.87 on its first 2 tokens "
                                                             "keeps floor 0.8")
        assert not settings[1].requests and gw.ledger_rows()[0].output_tokens == 8
