"""What a tenant learns when a tier's backend fails: what failed, in general words, never the upstream's URL, host,
port or the exception's repr. Operators keep those details: the admin /health, /admin/ops and the log."""

from __future__ import annotations

import json
import logging
import re
from urllib.parse import urlsplit

import pytest

from gateway.errors import InvalidRequest, RateLimited, Unavailable, UpstreamError, UpstreamTimeout, client_error
from tests.conftest import Gateway
from tests.stubs import free_port
from tiers import errors as tier_errors
from tiers.breaker import BreakerConfig, CircuitBreaker
from tiers.replica import Replica

MSG = [{"role": "user", "content": "hello there"}]
# an aiohttp connection error as tiers/client.py words it: `{url}: {exc!r}`
CONNECT_REPR = ("ClientConnectorError(ConnectionKey(host='127.0.0.1', port=37261, is_ssl=False, ssl=True, "
                "proxy=None, proxy_auth=None, proxy_headers_hash=None, server_hostname=None), "
                "ConnectionRefusedError(111, \"Connect call failed ('127.0.0.1', 37261)\"))")


def leaks(text: str, *ports: int) -> list[str]:
    """What of the deployment's internals `text` gives away."""
    found = [s for s in ("127.0.0.1", "localhost", "http://", "https://", "ClientConnectorError", "ConnectionKey",
                         "ConnectionRefusedError", "Traceback") if s in text]
    found += [f"port {p}" for p in ports if str(p) in text]
    if re.search(r"\w+(Error|Exception)\(", text):
        found.append("an exception's repr")
    return found


def small_port(gateway: Gateway) -> int:
    """The port of the dead URL the `small` tier points at."""
    url = gateway.app.state.services.fleet.replicas["small"][0].url
    return int(urlsplit(url).port)


# --- through a running gateway: `small` points at a dead URL (tests/conftest.py) ---------------------------------

def test_models_tells_a_tenant_why_a_tier_is_unavailable_without_its_url(gateway: Gateway) -> None:
    port = small_port(gateway)
    with gateway.client(gateway.tenant_key) as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    small = {m["id"]: m for m in r.json()["data"]}["small"]
    assert small["available"] is False
    assert small["unavailable_reason"] == "the tier's backend could not be reached"
    assert leaks(r.text, port) == []


def test_a_chat_on_a_tier_that_cannot_be_reached_says_so_without_its_url(gateway: Gateway) -> None:
    port = small_port(gateway)
    gateway.store.create_tenant("tiny", "smallonly")  # its only tier is down, no upgrade: 503
    _, key = gateway.store.issue_key("tiny")
    with gateway.client(key) as c:
        r = c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG})
        streamed = c.post("/v1/chat/completions", json={"model": "small", "messages": MSG, "stream": True})
    for answer in (r, streamed):
        err = answer.json()["error"]
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("service_unavailable", "no_tier_available")
        assert "small" in err["message"] and "could not be reached" in err["message"]
        assert leaks(answer.text, port) == [], answer.text


def test_a_request_routed_around_a_dead_tier_gives_no_url_in_its_route_reason(gateway: Gateway) -> None:
    port = small_port(gateway)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "small", "messages": MSG})
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid"
    reason = r.headers["x-tiergate-route-reason"]
    assert "small unavailable (the tier's backend could not be reached)" in reason
    assert leaks(reason, port) == []


def test_a_replica_unreachable_when_called_is_a_503_without_its_url(gateway: Gateway,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The health check passed, the call fails: UpstreamUnreachable, worded for the tenant, detailed in the log."""
    port = free_port()
    rep = gateway.app.state.services.fleet.replicas["mid"][0]
    rep.url = f"http://127.0.0.1:{port}"
    rep.breaker = CircuitBreaker(BreakerConfig(failures_to_open=100, cooldown_s=60))
    with caplog.at_level(logging.WARNING, logger="tiergate.errors"), gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "upstream_unreachable" and err["type"] == "service_unavailable"
    assert err["message"] == "the tier's backend could not be reached"
    assert leaks(r.text, port) == []
    assert f"127.0.0.1:{port}" in caplog.text  # the operator's copy


def test_an_upstream_dying_mid_stream_ends_the_stream_with_an_error_that_names_no_url(gateway: Gateway) -> None:
    port = int(urlsplit(gateway.app.state.services.fleet.replicas["mid"][0].url).port)
    with gateway.client(gateway.tenant_key) as c, c.stream(
            "POST", "/v1/chat/completions",
            json={"model": "mid", "messages": [{"role": "user", "content": "STUB:die"}], "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-1])
    assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["message"]
    assert leaks(events[-1], port) == [], events[-1]


def test_operators_still_read_the_details_on_the_admin_surfaces(gateway: Gateway) -> None:
    port = small_port(gateway)
    with gateway.client(gateway.admin_key) as c:
        health = c.get("/health").json()
        ops = c.get("/admin/ops").json()
    for tiers in (health["tiers"], ops["tiers"]):
        (replica,) = tiers["small"]["replicas"]
        assert f"127.0.0.1:{port}" in replica["reason"] and "health check failed" in replica["reason"]
    assert health["not_ready"]["small"]
    with gateway.client(gateway.tenant_key) as c:  # and a tenant's /health says only ready or not
        assert c.get("/health").json() == {"status": "starting"}


# --- the mapping itself (gateway/errors.py) ---------------------------------------------------------------------

URL = "http://127.0.0.1:37261/v1/chat/completions"


@pytest.mark.parametrize(("exc", "kind", "status", "code", "message"), [
    (tier_errors.UpstreamUnreachable(f"{URL}: {CONNECT_REPR}"), Unavailable, 503, "upstream_unreachable",
     "the tier's backend could not be reached"),
    (tier_errors.UpstreamTimedOut(f"{URL}: no data in 30.0s"), UpstreamTimeout, 504, "upstream_timeout",
     "the tier's backend did not answer in time"),
    (tier_errors.UpstreamRejected(500, {"error": {"message": f"Traceback (most recent call last): {URL}"}}),
     UpstreamError, 502, "upstream_error", "the tier's backend answered 500"),
    (tier_errors.UpstreamRejected(401, {"error": {"message": "bad key for http://10.0.0.7:8000"}}),
     UpstreamError, 502, "upstream_error", "the tier's backend answered 401"),
    (tier_errors.UpstreamProtocolError(f"{URL}: the stream ended without [DONE]"), UpstreamError, 502,
     "upstream_error", None),
    (tier_errors.TierError(f"{URL}: {CONNECT_REPR}"), UpstreamError, 502, "upstream_error",
     "the tier's backend failed"),
    (tier_errors.NoTierAvailable(f"no tier can serve this request now (small: health check failed: {URL}: "
                                 f"{CONNECT_REPR})"), Unavailable, 503, "no_tier_available",
     "no tier can serve this request now"),
])
def test_upstream_failures_reach_the_tenant_without_internal_details(
        exc: tier_errors.TierError, kind: type, status: int, code: str, message: str | None,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiergate.errors"):
        err = client_error(exc)
    assert type(err) is kind and err.status_code == status and err.code == code
    if message is not None:
        assert err.message == message
    assert leaks(json.dumps(err.body()), 37261) == []
    assert ("127.0.0.1" in caplog.text or "10.0.0.7" in caplog.text), "the details belong in the log"


def test_routing_reasons_without_internal_details_reach_the_tenant_unchanged() -> None:
    text = "no tier can serve this request now (small: starting; mid: predicted wait 3.0s > 1s)"
    err = client_error(tier_errors.NoTierAvailable(text))
    assert err.message == text and err.code == "no_tier_available" and err.status_code == 503


def test_an_upstream_4xx_about_the_request_passes_its_message_and_param() -> None:
    body = {"error": {"message": "response_format: the schema's `required` names a property it does not define",
                      "type": "invalid_request_error", "param": "response_format", "code": "invalid_response_format"}}
    err = client_error(tier_errors.UpstreamRejected(400, body))
    assert type(err) is InvalidRequest and err.status_code == 400
    assert (err.message, err.param, err.code) == (body["error"]["message"], "response_format",
                                                  "invalid_response_format")


def test_an_engine_whose_compile_queue_is_full_is_a_429_to_retry_not_a_502() -> None:
    """engine/compile_queue.py refuses a new response_format at once when a tenant's (or every tenant's) compiles
    are all taken; the tenant gets OpenAI's 429 with Retry-After, as for a rate limit, not a backend failure."""
    body = {"error": {"message": "response_format: this tenant's grammar compiles are all taken (at most 8 waiting); "
                                 "try again in 1 s", "type": "rate_limit_error", "param": "response_format",
                      "code": "response_format_compiles_busy"}}
    err = client_error(tier_errors.UpstreamRejected(429, body))
    assert type(err) is RateLimited and err.status_code == 429 and err.retry_after == 1
    assert (err.message, err.param, err.code) == (body["error"]["message"], "response_format",
                                                  "response_format_compiles_busy")
    other = client_error(tier_errors.UpstreamRejected(429, {"error": {"message": "slow down", "code": "x"}}))
    assert other.status_code == 502  # any other upstream 429 is still the backend's, not the tenant's


# --- the fleet's reasons (tiers/fleet.py) ------------------------------------------------------------------------

def test_a_replica_public_reason_is_its_state_never_its_own_reason() -> None:
    from tiers.fleet import public_reason

    remote = Replica("small", 0, url=URL)
    assert public_reason(remote) == "starting"
    remote.mark("down", f"health check failed: {URL}: {CONNECT_REPR}")
    assert public_reason(remote) == "the tier's backend could not be reached"
    local = Replica("mid", 0)
    local.mark("down", "engine exited with code -9; restarting in 2s")
    assert public_reason(local) == "unhealthy"
    local.mark("unavailable", "model 'x' is not built yet: run `tiergate models prepare x`")
    assert public_reason(local) == "its model is not prepared on this gateway"
    local.mark("ready", "")
    local.breaker = CircuitBreaker(BreakerConfig(failures_to_open=1, cooldown_s=60))
    local.breaker.failure("UpstreamUnreachable: boom")
    assert public_reason(local) == "circuit breaker open"
