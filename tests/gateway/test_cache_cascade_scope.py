"""The cache under a plan's cascade, through the HTTP API: a cascaded `auto` request is served only answers the
cascade's check accepted. An answer nothing checked (the cheap tier named explicitly, a stream the cascade could not
judge) is the cheap tier's answer to those requests, never `auto`'s; an answer the check accepted is kept for `auto`.

`small` is our engine's server over a scripted runner ("unsure.", every token at log-probability -0.25); plan
`unsure` rejects it (fixed threshold -0.1), plan `lenient` keeps it (-1.0); "easy" prompts go to `small`
(tests/gateway/test_routing_api.py's fake difficulty model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cache_api import wait_for_stores
from tests.gateway.test_cascade_logprobs import PLANS, calibrated, engine_small, settings  # noqa: F401 (fixtures)
from tests.gateway.test_routing_api import FakeDifficulty, chat, with_difficulty_model
from tests.stubs import REPLY, StubState
from tiers.predictor import PredictorSource

MORE_PLANS = """
  unsure_streams:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true, cascade_min_mean_logprob: -0.1, cascade_streams: true}
  lenient_budget:  # the floor relaxed to 0.6 as soon as anything is spent
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true, cascade_min_mean_logprob: -1.0,
              budget_thresholds: [{below_fraction: 0.999999, quality_floor: 0.6}]}
    limits: {budget_day_usd: "0.01"}
"""


@pytest.fixture
def plans(settings: tuple[Settings, StubState]) -> tuple[Settings, StubState]:  # noqa: F811
    settings[0].plans_file.write_text(PLANS + MORE_PLANS)
    return settings


def ask(gw: Gateway, content: str = "easy", **body: Any) -> httpx.Response:
    r = chat(gw, content, temperature=0, **body)
    assert r.status_code == 200, r.text
    wait_for_stores(gw)
    return r


def ask_streamed(gw: Gateway, content: str = "easy", **body: Any) -> str:
    """A streamed `auto` request's text."""
    req = {"model": "auto", "messages": [{"role": "user", "content": content}], "temperature": 0, "stream": True}
    with gw.client(gw.tenant_key) as c, c.stream("POST", "/v1/chat/completions", json=req | body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    wait_for_stores(gw)
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def test_an_answer_of_the_cheap_tier_named_explicitly_is_not_served_to_auto(plans: tuple[Settings, StubState],
                                                                            tmp_path: Path) -> None:
    with running_gateway(plans[0], plans[1], plan="unsure") as gw:
        with_difficulty_model(gw, tmp_path)
        first = ask(gw)
        assert first.headers["x-tiergate-cascade"] == "small->mid" and text(first) == REPLY
        named = ask(gw, model="small")  # not cascaded: small's answer, kept for requests that name small
        assert named.headers["x-tiergate-tier"] == "small" and text(named) == "unsure."
        assert ask(gw, model="small").headers["x-tiergate-cache"] == "hit"
        again = ask(gw)  # `auto` is checked again, and cascades again: not served small's unchecked answer
        assert again.headers.get("x-tiergate-cache") != "hit" and text(again) == REPLY
        assert again.headers["x-tiergate-cascade"] == "small->mid" and len(plans[1].requests) == 2


@pytest.mark.parametrize("plan", ["unsure", "unsure_streams"])  # streams not cascaded; held, with no look-ahead
def test_an_unchecked_streamed_answer_is_not_served_to_auto(plans: tuple[Settings, StubState], tmp_path: Path,
                                                            plan: str) -> None:
    with running_gateway(plans[0], plans[1], plan=plan) as gw:
        with_difficulty_model(gw, tmp_path)  # no cascade calibration: nothing judges a stream
        assert text(ask(gw)) == REPLY
        assert ask_streamed(gw) == "unsure."  # sent as it came, unchecked
        again = ask(gw)
        assert again.headers.get("x-tiergate-cache") != "hit" and text(again) == REPLY
        assert again.headers["x-tiergate-cascade"] == "small->mid"


def test_an_answer_the_cascade_accepted_is_kept_for_auto(plans: tuple[Settings, StubState], tmp_path: Path) -> None:
    with running_gateway(plans[0], plans[1], plan="lenient") as gw:
        with_difficulty_model(gw, tmp_path)
        first = ask(gw)
        assert first.headers["x-tiergate-cache"] == "miss" and text(first) == "unsure."
        repeat = ask(gw)
        assert repeat.headers["x-tiergate-cache"] == "hit" and text(repeat) == "unsure."
        assert repeat.headers["x-tiergate-tier"] == "small" and not plans[1].requests
        assert [row.cache_status for row in gw.ledger_rows()] == ["miss", "hit"]


def test_a_stream_the_look_ahead_accepted_is_kept_for_auto(plans: tuple[Settings, StubState],
                                                           tmp_path: Path) -> None:
    with calibrated(plans, tmp_path, 0.4, lookahead=2, plan="streamed") as gw:
        assert ask_streamed(gw, "anything", max_tokens=64) == "unsure."
        r = chat(gw, "anything", temperature=0, max_tokens=64)
        assert r.headers["x-tiergate-cache"] == "hit" and text(r) == "unsure."


def test_a_stream_the_look_ahead_rejected_is_not_kept(plans: tuple[Settings, StubState], tmp_path: Path) -> None:
    with calibrated(plans, tmp_path, 0.0, lookahead=2, plan="streamed") as gw:
        assert ask_streamed(gw, "anything", max_tokens=64) == REPLY  # the dearer tier's
        r = chat(gw, "anything", temperature=0, max_tokens=64)
        assert r.headers.get("x-tiergate-cache") != "hit" and r.headers["x-tiergate-cascade"] == "small->mid"


def test_an_answer_accepted_at_a_relaxed_floor_is_not_kept_for_the_plans_floor(plans: tuple[Settings, StubState],
                                                                               tmp_path: Path) -> None:
    """Accepted at the plan's floor (nothing spent yet): kept, and served at a relaxed floor too (it kept a higher
    one). Accepted at the relaxed floor: not kept, since the plan's floor is what the cache's scope names."""
    with running_gateway(plans[0], plans[1], plan="lenient_budget") as gw:
        with_difficulty_model(gw, tmp_path)
        strict = ask(gw)
        assert "floor 0.8" in strict.headers["x-tiergate-route-reason"] and text(strict) == "unsure."
        relaxed = ask(gw, "easy, once more")
        assert "floor 0.6" in relaxed.headers["x-tiergate-route-reason"] and text(relaxed) == "unsure."
        assert ask(gw, "easy, once more").headers["x-tiergate-cache"] == "miss"
        assert ask(gw).headers["x-tiergate-cache"] == "hit"


class Recalibrated(FakeDifficulty):
    version = "fake-2"


def test_an_answer_accepted_under_another_router_artifact_is_not_served_to_auto(
        plans: tuple[Settings, StubState], tmp_path: Path) -> None:
    """The check's thresholds are the router artifact's: once another artifact is in use, answers the old one's
    check accepted are not served as if the new one had (they were kept under the old artifact's version)."""
    with running_gateway(plans[0], plans[1], plan="lenient") as gw:
        with_difficulty_model(gw, tmp_path)
        assert ask(gw).headers["x-tiergate-cache"] == "miss"
        assert ask(gw).headers["x-tiergate-cache"] == "hit"  # kept, under fake-1
        artifact = tmp_path / "recalibrated.json"
        artifact.write_text("{}")
        gw.app.state.services.pipeline.route.predictor = PredictorSource(artifact, lambda _: Recalibrated())
        again = ask(gw)
        assert again.headers["x-tiergate-cache"] == "miss" and text(again) == "unsure."  # checked again, by fake-2
        assert ask(gw).headers["x-tiergate-cache"] == "hit"  # and kept under fake-2
