"""The cascade's stop at a divergence risk beside what surrounds it, end to end (test_cascade_stop.py's scripted
engines: `small` answers "unsure." in 8 tokens, each at 0.1 of risk; `mid` is the stub upstream): an Idempotency-Key
replays a stopped request's answer, billed once; the cache keeps only what the stop accepted, under the artifact's
version; the ladder's disable_cascade leaves a stopped answer standing; a client that leaves during the retry settles
both attempts once; a tier that sends no alternatives is not stopped on no evidence."""

from __future__ import annotations

import asyncio
import contextlib
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway
from tests.engine.fakes import ScriptedRunner
from tests.gateway.test_cache_api import wait_for_stores
from tests.gateway.test_cascade_logprobs import engine_small, settings, with_calibrated_model  # noqa: F401 (fixtures)
from tests.gateway.test_cascade_settles import held, wait_settled
from tests.gateway.test_cascade_stop import Stops, stopping
from tests.stubs import REPLY, StubState
from tiers.divergence import HAZARD_EDGES, DivergenceStop

BODY = {"model": "auto", "messages": [{"role": "user", "content": "anything"}], "max_tokens": 64, "temperature": 0}


def post(gw: Gateway, body: dict[str, Any] = BODY, **headers: str) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    wait_for_stores(gw)
    return r


def text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


class Versioned(Stops):
    """`Stops` under a version naming its threshold, as DifficultyModel.with_stops names the stops it holds."""

    def __init__(self, threshold: float) -> None:
        super().__init__(threshold)
        self.version = f"fake-cal+stop:{threshold}"


def test_a_stopped_request_is_replayed_under_its_idempotency_key_and_billed_once(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with stopping(settings, tmp_path, 0.25) as gw:
        first = post(gw, **{"idempotency-key": "stop-1"})
        assert first.headers["x-tiergate-cascade"] == "small->mid" and text(first) == REPLY
        again = post(gw, **{"idempotency-key": "stop-1"})
        assert again.headers.get("x-tiergate-idempotent-replay") == "true"
        assert again.json() == first.json()
        for name in ("x-tiergate-cascade", "x-tiergate-tier", "x-tiergate-route-reason"):
            assert again.headers[name] == first.headers[name], name
        rows = gw.ledger_rows()
        assert sorted(row.tier for row in rows) == ["mid", "small"] and len(settings[1].requests) == 1


def test_the_cache_keeps_what_the_stop_accepted_under_its_artifacts_version(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with stopping(settings, tmp_path, 5.0) as gw:
        with_calibrated_model(gw, tmp_path, Versioned(5.0))
        assert post(gw).headers["x-tiergate-cache"] == "miss"
        kept = post(gw)
        assert kept.headers["x-tiergate-cache"] == "hit" and text(kept) == "unsure."
        with_calibrated_model(gw, tmp_path, Versioned(0.25))  # retrained: another threshold, another version
        for _ in range(2):  # not served the old acceptance; stopped, and neither attempt's answer kept for auto
            r = post(gw)
            assert r.headers.get("x-tiergate-cache") != "hit" and r.headers["x-tiergate-cascade"] == "small->mid"
        assert len(settings[1].requests) == 2


def test_the_ladders_disable_cascade_leaves_a_stopped_answer_standing(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with stopping(settings, tmp_path, 0.25) as gw:
        with gw.client(gw.admin_key) as c:
            assert c.post("/admin/degrade/", json={"level": 1, "reason": "test"}).status_code == 200
        r = post(gw)
        assert r.headers["x-tiergate-tier"] == "small" and "x-tiergate-cascade" not in r.headers
        assert text(r) == "unsure." and r.headers["x-tiergate-route-reason"].endswith(
            "divergence risk 0.30 > 0.25 at token 3, not cascaded (degrade level 1)")
        (row,) = gw.ledger_rows()
        assert row.degrade_actions == "disable_cascade" and row.finish_reason == "stop" and row.output_tokens == 8
        assert not settings[1].requests


def test_a_client_that_leaves_during_the_retry_settles_both_attempts_once(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    """The client leaves once `mid` has been asked (its stub answers a word each 0.2 s: 1.2 s in all), whatever the
    machine's load: both attempts settle once, small's stopped and billed, mid's cancelled."""
    body = BODY | {"messages": [{"role": "user", "content": "anything STUB:slow"}]}
    with stopping(settings, tmp_path, 0.25) as gw:

        async def leave_once_mid_is_asked() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=60,
                                         headers={"authorization": f"Bearer {gw.tenant_key}"}) as c:
                asked = asyncio.create_task(c.post("/v1/chat/completions", json=body))
                deadline = time.monotonic() + 30
                while not settings[1].requests and not asked.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert not asked.done(), "the answer came before mid was asked and the client could leave"
                asked.cancel()  # the connection closes: the client is gone
                with contextlib.suppress(asyncio.CancelledError):
                    await asked

        asyncio.run(leave_once_mid_is_asked())
        wait_settled(gw, 2)
        time.sleep(0.5)  # a row settled twice would come after
        assert held(gw) == [] and len(settings[1].requests) == 1
        rows = {row.tier: row for row in gw.ledger_rows()}
        assert len(gw.ledger_rows()) == 2 and rows["mid"].cascade_of == rows["small"].request_id
        assert (rows["small"].status, rows["small"].finish_reason, rows["small"].output_tokens) == ("ok", "cascaded",
                                                                                                   3)
        assert (rows["mid"].status, rows["mid"].http_status) == ("cancelled", 499)


def one_alternative(runner: ScriptedRunner) -> None:
    """The scripted runner's tokens come with their own log-probability alone (a tier that sends no alternatives)."""
    run = runner.run

    def alone(out: Any) -> list[int]:
        made = run(out)
        runner.last_logprobs = {k: (lp, top[:1]) for k, (lp, top) in runner.last_logprobs.items()}
        return made

    runner.run = alone  # type: ignore[method-assign]


class Unsure(Stops):
    """A stop whose every bin, the last (no margin known) too, has a rate of 0.1: a fitted hazard is never 0
    (training/divergence_fit.py smooths it)."""

    def __init__(self, threshold: float) -> None:
        super().__init__(threshold)
        hazard = tuple(0.1 for _ in pairwise(HAZARD_EDGES))
        self.cascade.stops = {"small->mid": DivergenceStop("small", "mid", HAZARD_EDGES, hazard, 0.0, 48, threshold,
                                                             0.95)}


@pytest.mark.parametrize("model", [Stops, Unsure])
def test_a_tier_that_sends_no_alternatives_is_not_stopped(
        settings: tuple[Settings, StubState], engine_small: tuple[str, ScriptedRunner],  # noqa: F811
        tmp_path: Path, model: type[Stops]) -> None:
    one_alternative(engine_small[1])
    with stopping(settings, tmp_path, 0.25) as gw:
        with_calibrated_model(gw, tmp_path, model(0.25))
        r = post(gw)
        assert r.headers["x-tiergate-tier"] == "small" and "x-tiergate-cascade" not in r.headers, r.headers
        assert r.headers["x-tiergate-route-reason"].endswith(
            "; divergence risk not checked (the tier sent no top log-probabilities)")
        assert text(r) == "unsure." and not settings[1].requests
