"""The request path under faults: a client that leaves stops its work, an unexpected error still settles
exactly once (slot, lease and reservation back), and the gate refuses a flooding tenant cheaply."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from gateway.errors import NOT_READY_MESSAGE
from gateway.pipeline.tier_call import TierCaller
from tests.conftest import Gateway, running_gateway
from tests.stubs import REPLY

N = len(REPLY.split())
SLOW = [{"role": "user", "content": "STUB:slow"}]


def _wait(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and not condition():
        time.sleep(0.05)


def test_a_non_streamed_client_that_leaves_is_cancelled_upstream_and_billed_for_what_ran(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json={"model": "mid", "messages": SLOW}, timeout=0.7)
    _wait(lambda: gateway.ledger_rows() and gateway.stub.finished)
    (row,) = gateway.ledger_rows()
    assert row.status == "cancelled" and row.http_status == 499
    assert 1 <= row.output_tokens < N  # what ran before the client left, not the whole answer
    assert row.price_usd > 0
    assert gateway.stub.finished == ["disconnected"]  # the upstream was told to stop


def test_a_request_abandoned_while_queued_never_takes_a_slot(gateway: Gateway) -> None:
    services = gateway.app.state.services
    queue = services.queues["mid"]
    queue.capacity = 1
    with gateway.client(gateway.tenant_key) as busy, busy.stream(
            "POST", "/v1/chat/completions", json={"model": "mid", "messages": SLOW, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # holding the only slot
        with gateway.client(gateway.tenant_key) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json={"model": "mid", "messages": SLOW}, timeout=0.5)
        _wait(lambda: queue.num_waiting == 0)
        assert queue.num_waiting == 0 and queue.in_flight == 1
    _wait(lambda: queue.in_flight == 0)
    assert queue.in_flight == 0
    assert len(gateway.stub.requests) == 1  # the abandoned request never reached the tier
    with gateway.client(gateway.tenant_key) as c:  # and the slot serves the next request at once
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200


def test_an_unexpected_error_after_the_reservation_still_settles_everything(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    services = gateway.app.state.services

    async def broken(self: TierCaller, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the tier call")

    monkeypatch.setattr(TierCaller, "open", broken)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "a bug" not in r.text  # the details are logged, not shown
    _wait(lambda: gateway.ledger_rows())
    (row,) = gateway.ledger_rows()
    assert (row.status, row.http_status, row.error_code) == ("error", 500, "internal_error")
    assert services.queues["mid"].in_flight == 0  # the dispatch slot is back
    gate = services.pipeline.gate
    assert gate.in_flight("acme") == 0  # the gate's place is back
    backend = services.quota_backend  # the concurrency lease is back, and only what ran is charged
    state = backend._state["acme", "t"]
    assert state.inflight == {} and state.token_sum == 0


def test_the_gate_refuses_a_tenant_over_its_concurrency_before_any_work(
        gateway_settings: Any, stub: Any, tmp_path: Any) -> None:
    (tmp_path / "plans.yaml").write_text("""
default_plan: one
plans:
  one:
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {max_concurrent: 1}
""")
    settings = gateway_settings.model_copy(update={"plans_file": tmp_path / "plans.yaml"})
    with running_gateway(settings, stub[1], plan="one") as gw, gw.client(gw.tenant_key) as busy, busy.stream(
            "POST", "/v1/chat/completions", json={"model": "mid", "messages": SLOW, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        with gw.client(gw.tenant_key) as c:
            refused = c.post("/v1/chat/completions", json={"model": "mid", "messages": SLOW})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_concurrency"
        assert refused.headers["retry-after"] == "1"
        assert len(gw.stub.requests) == 1


def test_the_gate_remembers_a_rate_refusal_with_the_exact_checks_retry_time(gateway: Gateway) -> None:
    gate = gateway.app.state.services.pipeline.gate
    gate.rate_refused("acme", 30.0)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_rpm"
    assert 29 <= int(r.headers["retry-after"]) <= 30
    assert gateway.stub.requests == []


# why a PostgreSQL ledger could not commit, in the driver's words (quotas/ledger.py's `_fault`): an operator's to read
DRIVER_FAULT = ('ledger cannot commit: connection to server at "10.20.30.40", port 5432 failed: FATAL: could not '
                'extend file "base/16384/16385": disk full\nDETAIL: user "tiergate_ledger" (OperationalError)')


def test_a_ledger_that_cannot_write_makes_the_gateway_refuse_new_work(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tenant reads a fixed sentence, the Retry-After and its request id; why (the database driver's error, with
    the server's address and user) is the admin's, on /health, and the log's."""
    ledger = gateway.app.state.services.ledger
    monkeypatch.setattr(type(ledger), "not_ready_reason", property(lambda self: DRIVER_FAULT), raising=False)
    with gateway.client(gateway.tenant_key) as c:
        chat = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
        embeddings = c.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": ["hi"]})
    for r in (chat, embeddings):
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert r.json()["error"]["message"] == NOT_READY_MESSAGE and r.headers["retry-after"] == "5"
        assert r.headers["x-tiergate-request-id"]
        assert "disk full" not in r.text and "10.20.30.40" not in r.text and "tiergate_ledger" not in r.text
    assert gateway.stub.requests == []
    with gateway.client() as anonymous, gateway.client(gateway.admin_key) as admin:
        assert anonymous.get("/health").status_code == 503  # load balancers stop sending work here
        assert "disk full" not in anonymous.get("/health").text
        assert admin.get("/health").json()["ledger"] == DRIVER_FAULT


def test_a_json_answer_that_fails_midway_bills_the_prompt_only(gateway: Gateway) -> None:
    """The client got an error and none of the text, so none of the output is billed (a stream's client has
    the text so far and pays for it: tests/gateway/test_chat_api.py)."""
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "STUB:die"}]})
    assert r.status_code >= 500 and "error" in r.json()
    (row,) = gateway.ledger_rows()
    tier = gateway.app.state.services.catalogue.tiers["mid"]
    assert row.status == "error" and row.input_tokens > 0 and row.output_tokens == 0
    assert row.price_usd == tier.price(row.input_tokens, 0)
