"""The cascade's log-probability check end to end: our engine's server returns token log-probabilities,
the gateway asks for them only where the plan sets a threshold, and an unsure cheap answer is retried."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from gateway.settings import Settings
from tests.conftest import running_gateway
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.gateway.test_routing_api import LADDER, chat, tiers_yaml, with_difficulty_model
from tests.stubs import REPLY, ServerThread, StubState, stub_app

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
"""


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
