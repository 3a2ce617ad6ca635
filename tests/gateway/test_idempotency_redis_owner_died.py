"""Idempotency-Key claims in Redis beside the gateway's own ledger (replicas without a database): a gateway that
died after its request's row was written and before its answer was stored in Redis leaves a claim whose lease
lapses. The retry, on a gateway reading the same ledger, is told the request ran and was billed (409
`idempotency_answer_not_kept`), never run and billed a second time: the gateway hands its ledger to the store
(gateway/stores.py `open_idempotency`; quotas/idempotency_redis.py reads the dead owner's row)."""

from __future__ import annotations

import time
from typing import Any

from gateway.settings import Settings
from tests.conftest import running_gateway
from tests.gateway.test_idempotency_redis_faults import refusing, store_of
from tests.stubs import ServerThread, StubState

BODY = {"model": "mid", "messages": [{"role": "user", "content": "hello there"}]}
LEASE_S = 1.0


def test_a_retry_after_the_owner_died_between_its_row_and_its_answer_is_not_run_again(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str) -> None:
    settings = gateway_settings.model_copy(update={"redis_url": redis_url})
    with running_gateway(settings, stub[1]) as first:
        store: Any = store_of(first)
        store._finish = refusing(store._finish)  # the answer never reaches Redis: its gateway stops first
        first.app.state.services.pipeline.idempotency.lease_s = LEASE_S
        with first.client(first.tenant_key) as c:
            r = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-7"})
        assert r.status_code == 200, r.text
    assert len(first.stub.requests) == 1 and len(first.ledger_rows()) == 1  # ran and billed, once
    time.sleep(LEASE_S * 1.5)  # its claim's lease lapses: nobody renews it
    with running_gateway(settings, stub[1]) as again, again.client(again.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-7"})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("idempotency_answer_not_kept", "Idempotency-Key"), error
        assert "was lost" in error["message"], error
    assert len(again.stub.requests) == 1 and len(again.ledger_rows()) == 1  # not run, not billed again
