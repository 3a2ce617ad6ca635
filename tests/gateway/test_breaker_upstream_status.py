"""Which upstream answers a replica's circuit breaker counts, through the gateway: exactly those the tenant reads as
the gateway's 502 (the tier's fault: its key, path or model name, a 5xx, a rate limit on the tier's account), never
an answer about the tenant's own request (400, 413, 422; our engine's compile queue full, a 429 the tenant retries).

Before, any upstream 4xx counted as the replica's success: a remote tier whose key was wrong (401) or whose model
name was (404) answered every tenant 502 and stayed "healthy", so `auto` kept sending traffic there instead of
falling over to another tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import UpstreamError, client_error
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway import test_upstream_strings
from tests.gateway.test_routing_api import LADDER, PLANS, empty_stub, tiers_yaml, with_difficulty_model
from tests.gateway.test_upstream_strings import Hostile
from tests.stubs import ServerThread, StubState, stub_app
from tiers import errors as tier_errors
from wire.errors import RESPONSE_FORMAT_COMPILES_BUSY

NOT_FOUND = {"message": "The model `stub-full` does not exist.", "type": "invalid_request_error", "param": "model",
             "code": "model_not_found"}
BAD_KEY = {"message": "Incorrect API key provided.", "type": "invalid_request_error", "code": "invalid_api_key"}
TOO_LONG = {"message": "the prompt is too long", "type": "invalid_request_error", "param": "messages",
            "code": "context_length_exceeded"}
SLOW_DOWN = {"message": "Rate limit reached for requests", "type": "requests", "code": "rate_limit_exceeded"}
COMPILES_BUSY = {"message": "8 new response formats of yours are already compiling", "type": "rate_limit_error",
                 "param": "response_format", "code": RESPONSE_FORMAT_COMPILES_BUSY}
hostile = test_upstream_strings.hostile  # the fixture: a Hostile upstream, stopped after the test
FELL_BACK = "full unavailable (circuit breaker open on every healthy replica); fell back to mid"


@pytest.fixture
def full_hostile(gateway_settings: Settings, hostile: Hostile, tmp_path: Path) -> Iterator[tuple[Gateway, StubState]]:
    """`full` is the hostile upstream, `mid` a plain stub (its state comes with the gateway); `auto` sends "hard"
    prompts to `full`."""
    small, mid = StubState(), StubState()
    servers = [ServerThread(empty_stub(small)).start(), ServerThread(stub_app(mid)).start()]
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(servers[0].url, [servers[1].url], hostile.server.url))
    (tmp_path / "plans.yaml").write_text(PLANS)
    (tmp_path / "ladder.yaml").write_text(LADDER)
    settings = gateway_settings.model_copy(update={"ladder_file": tmp_path / "ladder.yaml"})
    try:
        with running_gateway(settings, mid, plan="routed") as gw:
            with_difficulty_model(gw, tmp_path)
            yield gw, mid
    finally:
        for s in servers:
            s.stop()


def hard(gw: Gateway) -> Any:
    with gw.client(gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": "auto", "messages": [{"role": "user", "content": "hard"}]})


@pytest.mark.parametrize(("status", "error"), [(401, BAD_KEY), (404, NOT_FOUND), (429, SLOW_DOWN),
                                               (500, {"message": "boom", "type": "api_error"})],
                         ids=["401", "404", "429", "500"])
def test_a_tier_answering_the_gateways_502_opens_its_breaker_and_auto_falls_over(
        full_hostile: tuple[Gateway, StubState], hostile: Hostile, status: int, error: dict[str, Any]) -> None:
    gw, mid = full_hostile
    hostile.status, hostile.error = status, error
    (rep,) = gw.app.state.services.fleet.replicas["full"]
    needed = rep.breaker.config.failures_to_open
    for i in range(needed):
        r = hard(gw)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", (i, r.text)
        assert len(hostile.state.requests) == i + 1  # full was asked: no other tier answered for it
    assert rep.breaker.state == "open"
    for _ in range(3):  # the next requests go to mid, and full sees none of them
        r = hard(gw)
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid", r.text
        assert FELL_BACK in r.headers["x-tiergate-route-reason"]
    assert len(hostile.state.requests) == needed and len(mid.requests) == 3


def test_answers_about_the_tenants_request_never_open_the_breaker(full_hostile: tuple[Gateway, StubState],
                                                                   hostile: Hostile) -> None:
    """A tenant sending bad requests, however many, must not take the tier away from everyone."""
    gw, mid = full_hostile
    (rep,) = gw.app.state.services.fleet.replicas["full"]
    n = 2 * rep.breaker.config.failures_to_open
    asked = 0
    for status, error, seen in ((400, TOO_LONG, 400), (413, TOO_LONG, 400), (422, TOO_LONG, 400),
                                (429, COMPILES_BUSY, 429)):
        hostile.status, hostile.error = status, error
        for i in range(n):
            r = hard(gw)
            assert r.status_code == seen and r.json()["error"]["code"] == error["code"], (status, i, r.text)
        asked += n
        assert rep.breaker.state == "closed" and rep.breaker.consecutive_failures == 0, status
        assert len(hostile.state.requests) == asked and not mid.requests, status  # full was asked every time


def test_the_breaker_counts_exactly_what_the_tenant_reads_as_a_502() -> None:
    """One definition (`UpstreamRejected.replica_failed`) for both: the tenant's 502 and the breaker's failure."""
    for status in (*range(400, 452), *range(500, 512)):
        for code in (None, RESPONSE_FORMAT_COMPILES_BUSY, "model_not_found"):
            exc = tier_errors.UpstreamRejected(status, {"error": {"message": "m", "code": code}})
            assert (type(client_error(exc)) is UpstreamError) == exc.replica_failed, (status, code)
            assert exc.replica_failed == (status not in (400, 413, 422)
                                          and (status, code) != (429, RESPONSE_FORMAT_COMPILES_BUSY)), (status, code)
