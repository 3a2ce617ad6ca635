"""The cascade's log-probability checks end to end: our engine's server returns token log-probabilities, the
gateway asks for them only where the plan's cascade reads them, and an unsure cheap answer is retried: below a
plan's fixed threshold, or below what the router artifact's calibrated confidence needs for the plan's floor
(the cascade policy, and `auto`'s fallback when the difficulty model cannot predict the cheap tier)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.gateway.test_routing_api import LADDER, chat, tiers_yaml, with_difficulty_model
from tests.stubs import REPLY, ServerThread, StubState, stub_app
from tiers.difficulty import CascadeCalibration, ConfidenceHead, Lookahead, RidgeHead
from tiers.predictor import PredictorSource
from training.confidence import pair_thresholds

PLANS = """
default_plan: unsure
plans:
  unsure:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true, cascade_min_mean_logprob: -0.1}
  lenient:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true, cascade_min_mean_logprob: -1.0}
  # the calibrated check; the fixed threshold (-5: never met) makes today's gateway ask for log-probabilities
  exacting:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.9, policy: cascade, cascade_min_mean_logprob: -5.0}
  relaxed:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, policy: cascade, cascade_min_mean_logprob: -5.0}
  predicted:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.9, cascade: true, cascade_min_mean_logprob: -5.0}
  # no fixed threshold: the log-probabilities (with alternatives) are asked for by the calibrated check alone
  checked:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, policy: cascade}
  # streams held for the look-ahead
  streamed:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, policy: cascade, cascade_streams: true}
"""


class Calibrated:
    """A difficulty model that cannot predict `small` (its CV error is the mean's), with a cascade calibration
    whose confidence is the mean log-probability mapped onto [0, 1] over [-2, 0]: the scripted runner's -0.25
    per token is 0.875, enough for a floor of 0.8, not for 0.9."""

    version = "fake-cal"

    def __init__(self) -> None:
        self.uninformative = {"small": "CV RMSE 0.1247 vs 0.1248 predicting the mean"}
        ridge = RidgeHead(np.zeros(1), np.ones(1), np.ones(1), 0.0, 1.0, 0.1, 0.1, 100, 0.7, True)
        head = ConfidenceHead(["mean_logprob"], ridge, np.array([-2.0, 0.0]), np.array([0.0, 1.0]))
        self.cascade = CascadeCalibration(5, {"small": head}, {"small->mid": pair_thresholds(head, "small", "mid",
                                                                                              1.0)})

    def predict(self, messages: list[dict[str, Any]]) -> dict[str, float]:
        return {"small": 0.3, "mid": 0.95, "full": 1.0}  # mid, were small's number worth anything


class ReadsAlternatives(Calibrated):
    """A calibration whose head reads the entropy of each token's alternatives (which only `top_logprobs`
    gives): confidence = `sureness` - mean entropy, mapped onto [0, 1] over [-1, 0]. The scripted runner's two
    alternatives (-0.25, -1.5) have entropy 0.529: sureness 0.4 gives 0.87 (keeps floor 0.8), 0 gives 0.47.
    With `lookahead`, the heads are the look-ahead's, read on the answer's first that many tokens."""

    def __init__(self, sureness: float, lookahead: int | None = None) -> None:
        super().__init__()
        ridge = RidgeHead(np.zeros(1), np.ones(1), -np.ones(1), sureness, 1.0, 0.1, 0.1, 100, 0.7, True)
        head = ConfidenceHead(["mean_entropy"], ridge, np.array([-1.0, 0.0]), np.array([0.0, 1.0]))
        pairs = {"small->mid": pair_thresholds(head, "small", "mid", 1.0)}
        if lookahead is None:
            self.cascade = CascadeCalibration(5, {"small": head}, pairs)
        else:
            self.cascade = CascadeCalibration(5, {}, {}, lookahead=Lookahead(lookahead, {"small": head}, pairs))


@contextlib.contextmanager
def calibrated(settings: tuple[Settings, StubState], tmp_path: Path, sureness: float, lookahead: int | None = None,
               plan: str = "checked") -> Iterator[Gateway]:
    """A gateway whose router artifact reads alternatives (`ReadsAlternatives`)."""
    with running_gateway(settings[0], settings[1], plan=plan) as gw:
        with_calibrated_model(gw, tmp_path, ReadsAlternatives(sureness, lookahead))
        yield gw


def with_calibrated_model(gw: Gateway, tmp_path: Path, model: Any = None) -> None:
    artifact = tmp_path / "difficulty.json"
    artifact.write_text("{}")
    gw.app.state.services.pipeline.route.predictor = PredictorSource(artifact, lambda _: model or Calibrated())



@pytest.fixture
def engine_small() -> Iterator[tuple[str, ScriptedRunner]]:
    """`small` is our engine's real server over a scripted runner whose every token has log-probability -0.25."""
    runner = ScriptedRunner(reply="unsure.", max_model_len=4096, num_kv_blocks=512)
    engine = LLMEngine(runner, CharTokenizer())
    engine.start()
    server = ServerThread(create_engine_app(engine, model_name="stub-small", model_version="v1")).start()
    yield server.url, runner
    server.stop()
    engine.shutdown()


@pytest.fixture
def settings(gateway_settings: Settings, engine_small: tuple[str, ScriptedRunner], tmp_path: Path
             ) -> Iterator[tuple[Settings, StubState]]:
    mid = StubState()
    servers = [ServerThread(stub_app(mid)).start(), ServerThread(stub_app(StubState())).start()]
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(engine_small[0], [servers[0].url], servers[1].url))
    (tmp_path / "plans.yaml").write_text(PLANS)
    (tmp_path / "ladder.yaml").write_text(LADDER)
    yield gateway_settings.model_copy(update={"ladder_file": tmp_path / "ladder.yaml"}), mid
    for s in servers:
        s.stop()


def test_an_unsure_answer_from_our_engine_cascades(settings: tuple[Settings, StubState], tmp_path: Path) -> None:
    with running_gateway(settings[0], settings[1], plan="unsure") as gw:
        with_difficulty_model(gw, tmp_path)
        r = chat(gw, "easy")  # the fake difficulty model sends "easy" to small
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-cascade"] == "small->mid"
        assert r.json()["choices"][0]["message"]["content"] == REPLY
        first = next(row for row in gw.ledger_rows() if row.tier == "small")
        assert "mean token log-probability -0.25 < -0.1" in first.route_reason
        assert len(settings[1].requests) == 1 and len(gw.ledger_rows()) == 2


def test_a_sure_enough_answer_stands(settings: tuple[Settings, StubState], tmp_path: Path) -> None:
    with running_gateway(settings[0], settings[1], plan="lenient") as gw:
        with_difficulty_model(gw, tmp_path)
        r = chat(gw, "easy")
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small"
        assert "x-tiergate-cascade" not in r.headers and r.json()["choices"][0]["message"]["content"] == "unsure."
        assert not settings[1].requests


def test_the_cascade_policy_retries_an_answer_below_the_calibrated_bar(settings: tuple[Settings, StubState],
                                                                      tmp_path: Path) -> None:
    with running_gateway(settings[0], settings[1], plan="exacting") as gw:
        with_calibrated_model(gw, tmp_path)
        r = chat(gw, "anything")
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-cascade"] == "small->mid" and r.json()["choices"][0]["message"]["content"] == REPLY
        first = next(row for row in gw.ledger_rows() if row.tier == "small")
        assert first.route_reason.startswith("auto: cascade policy: small first, kept if its confidence reaches "
                                             "floor 0.9; calibrated confidence 0.88 < 0.90 needed for floor 0.9: "
                                             "cascaded to mid")
        assert len(gw.ledger_rows()) == 2 and all(row.price_usd > 0 for row in gw.ledger_rows())


def test_the_cascade_policy_keeps_an_answer_that_clears_the_bar(settings: tuple[Settings, StubState],
                                                               tmp_path: Path) -> None:
    with running_gateway(settings[0], settings[1], plan="relaxed") as gw:
        with_calibrated_model(gw, tmp_path)
        r = chat(gw, "anything")
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small"
        assert "x-tiergate-cascade" not in r.headers and r.json()["choices"][0]["message"]["content"] == "unsure."
        assert r.headers["x-tiergate-route-reason"].endswith("; calibrated confidence 0.88 keeps floor 0.8")
        assert not settings[1].requests and len(gw.ledger_rows()) == 1


def test_a_router_that_cannot_predict_says_so_and_falls_back_to_the_cascade(settings: tuple[Settings, StubState],
                                                                           tmp_path: Path) -> None:
    with running_gateway(settings[0], settings[1], plan="predicted") as gw:
        with_calibrated_model(gw, tmp_path)
        r = chat(gw, "anything")
        assert r.status_code == 200 and r.headers["x-tiergate-cascade"] == "small->mid"
        first = next(row for row in gw.ledger_rows() if row.tier == "small")
        assert first.route_reason.startswith(
            "auto: difficulty model fake-cal cannot predict small (CV RMSE 0.1247 vs 0.1248 predicting the mean): "
            "cascade policy, small first")
        assert "calibrated confidence 0.88 < 0.90 needed for floor 0.9" in first.route_reason


def test_the_gateway_asks_for_the_alternatives_a_calibrated_head_reads(settings: tuple[Settings, StubState],
                                                                       tmp_path: Path) -> None:
    """No fixed threshold in the plan: the calibrated check alone makes the gateway ask for log-probabilities
    with the calibration's alternatives, and its entropy is read (not "not checked")."""
    with calibrated(settings, tmp_path, 0.4) as gw:
        r = chat(gw, "anything")
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small", r.text
        assert r.headers["x-tiergate-route-reason"].endswith("; calibrated confidence 0.87 keeps floor 0.8")
        assert "logprobs" not in r.json()["choices"][0] or r.json()["choices"][0]["logprobs"] is None
    with calibrated(settings, tmp_path, 0.0) as gw:
        r = chat(gw, "anything")
        assert r.status_code == 200 and r.headers["x-tiergate-cascade"] == "small->mid", r.text
        first = [row for row in gw.ledger_rows() if row.tier == "small"][-1]  # the first gateway's row came before
        assert "calibrated confidence 0.47 < 0.80 needed for floor 0.8: cascaded to mid" in first.route_reason


def test_an_answer_that_fails_the_look_ahead_is_cut_there_and_retried(settings: tuple[Settings, StubState],
                                                                     tmp_path: Path) -> None:
    with calibrated(settings, tmp_path, 0.0, lookahead=2) as gw:
        r = chat(gw, "anything", max_tokens=64)
        assert r.status_code == 200 and r.headers["x-tiergate-cascade"] == "small->mid", r.text
        assert r.json()["choices"][0]["message"]["content"] == REPLY
        first = next(row for row in gw.ledger_rows() if row.tier == "small")
        assert "calibrated confidence 0.47 on its first 2 tokens < 0.80 needed for floor 0.8: cascaded to mid" in (
            first.route_reason)
        # judged on its third token and not read further: billed for what came, not the whole answer's 8
        assert first.finish_reason == "cascaded" and 3 <= first.output_tokens < 8, first
        assert first.price_usd > 0 and len(gw.ledger_rows()) == 2


def test_an_answer_that_passes_the_look_ahead_stands_whole(settings: tuple[Settings, StubState],
                                                           tmp_path: Path) -> None:
    with calibrated(settings, tmp_path, 0.4, lookahead=2) as gw:
        r = chat(gw, "anything", max_tokens=64)
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "small", r.text
        assert r.json()["choices"][0]["message"]["content"] == "unsure."
        assert r.headers["x-tiergate-route-reason"].endswith(
            "; calibrated confidence 0.87 on its first 2 tokens keeps floor 0.8")
        row = gw.ledger_rows()[0]  # read to its end: its 7 characters and the end token
        assert not settings[1].requests and row.finish_reason == "stop" and row.output_tokens == 8


def test_an_answer_shorter_than_the_look_ahead_is_judged_at_its_end(settings: tuple[Settings, StubState],
                                                                    tmp_path: Path) -> None:
    with calibrated(settings, tmp_path, 0.0, lookahead=32) as gw:
        r = chat(gw, "anything", max_tokens=64)
        assert r.status_code == 200 and r.headers["x-tiergate-cascade"] == "small->mid", r.text
        first = next(row for row in gw.ledger_rows() if row.tier == "small")
        assert first.finish_reason == "stop" and "on its first 32 tokens < 0.80" in first.route_reason


def stream_chat(gw: Gateway) -> tuple[int, dict[str, str], str]:
    """A streamed `auto` request: status, headers and the text of its content deltas."""
    body = {"model": "auto", "messages": [{"role": "user", "content": "anything"}], "max_tokens": 64, "stream": True}
    with gw.client(gw.tenant_key) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        status, headers = r.status_code, dict(r.headers)
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    return status, headers, "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])


def test_a_stream_that_fails_the_look_ahead_is_answered_by_the_dearer_tier_alone(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:
    with calibrated(settings, tmp_path, 0.0, lookahead=2, plan="streamed") as gw:
        status, headers, text = stream_chat(gw)
        assert status == 200 and headers["x-tiergate-cascade"] == "small->mid"
        assert text == REPLY  # nothing of small's answer reached the client
        first = next(row for row in gw.ledger_rows() if row.tier == "small")
        assert first.finish_reason == "cascaded" and 3 <= first.output_tokens < 8, first
        assert len(settings[1].requests) == 1 and settings[1].requests[0]["stream"] is True


def test_a_stream_that_passes_the_look_ahead_is_sent_whole(settings: tuple[Settings, StubState],
                                                           tmp_path: Path) -> None:
    with calibrated(settings, tmp_path, 0.4, lookahead=2, plan="streamed") as gw:
        status, headers, text = stream_chat(gw)
        assert status == 200 and text == "unsure." and "x-tiergate-cascade" not in headers
        assert headers["x-tiergate-route-reason"].endswith("; calibrated confidence 0.87 on its first 2 tokens keeps "
                                                           "floor 0.8")
        assert not settings[1].requests and gw.ledger_rows()[0].output_tokens == 8


def test_a_stream_is_not_held_or_checked_without_the_plans_consent(settings: tuple[Settings, StubState],
                                                                   tmp_path: Path) -> None:
    with calibrated(settings, tmp_path, 0.0, lookahead=2) as gw:
        status, headers, text = stream_chat(gw)
        assert status == 200 and text == "unsure." and "x-tiergate-cascade" not in headers
        assert not settings[1].requests and len(gw.ledger_rows()) == 1
