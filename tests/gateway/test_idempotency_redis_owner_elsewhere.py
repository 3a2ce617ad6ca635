"""Idempotency-Key claims in Redis shared by replicas that each write a ledger of their own (a SQLite file per host,
no fleet database): a gateway that died after its request's row was written and before its answer was stored in
Redis leaves a claim whose lease lapses, and its row is in its own ledger, which the replica that gets the retry
cannot read. The retry ran there and was billed a second time (it looked only in its own ledger, found nothing and took
the key over); now it is a 409 that says whether the request ran is not known here, never run again under the key
(quotas/idempotency_redis.py, quotas/ledger_identity.py). With a fleet database the records are in PostgreSQL, committed
with the row, so the same retry replays the answer (tests/gateway/test_idempotency_api.py's
`test_a_replica_that_did_not_serve_the_first_request_replays_it`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from gateway.settings import Settings
from gateway.stores import open_idempotency, open_ledger
from quotas.idempotency_postgres import PostgresIdempotency
from tests.conftest import running_gateway
from tests.gateway.test_idempotency_redis_faults import refusing, store_of
from tests.stubs import ServerThread, StubState

BODY = {"model": "mid", "messages": [{"role": "user", "content": "hello there"}]}


def test_a_retry_on_a_replica_with_another_ledger_after_the_owner_died_is_not_run_again(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str, tmp_path: Path) -> None:
    a_settings = gateway_settings.model_copy(update={"redis_url": redis_url})
    b_settings = a_settings.model_copy(update={"data_dir": tmp_path / "b"})  # its own ledger file
    with running_gateway(a_settings, stub[1]) as a:
        store: Any = store_of(a)
        store._finish = refusing(store._finish)  # the answer never reaches Redis: its gateway stops first
        with a.client(a.tenant_key) as c:
            r = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-8"})
        assert r.status_code == 200, r.text
    assert len(a.stub.requests) == 1 and len(a.ledger_rows()) == 1  # ran and billed, once, in a's ledger
    lapse(redis_url, "order-8")  # its claim's lease ends: nobody renews it (at once here, not 10 minutes on)
    with running_gateway(b_settings, stub[1]) as b, b.client(b.tenant_key) as c:
        for _ in range(2):  # every retry is told, none runs
            r = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-8"})
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert (error["code"], error["param"]) == ("idempotency_answer_not_kept", "Idempotency-Key"), error
            assert "another gateway" in error["message"] and "new key" in error["message"], error
        r = c.post("/v1/chat/completions", json={**BODY, "max_tokens": 5}, headers={"idempotency-key": "order-8"})
        assert r.status_code == 422, r.text  # another body with the key: refused as ever
        assert len(b.stub.requests) == 1 and b.ledger_rows() == []  # not run, not billed again


async def test_with_a_fleet_database_and_redis_the_records_commit_with_the_fleet_ledger(
        gateway_settings: Settings, redis_url: str, database_url: str) -> None:
    """Replicas sharing Redis and a PostgreSQL ledger keep their records in PostgreSQL, not Redis: an answer commits
    with its row, so no claim of a dead owner ever has a row without its answer (the retry replays it)."""
    settings = gateway_settings.model_copy(update={"redis_url": redis_url, "database_url": database_url})
    ledger = open_ledger(settings)
    store = open_idempotency(settings, ledger)
    try:
        assert isinstance(store, PostgresIdempotency)
    finally:
        await store.close()
        ledger.close()


def lapse(url: str, key: str) -> None:
    """The claim of `key` as its record is once its lease has ended (Redis' clock, in ms, past its `lease`)."""
    with redis.Redis.from_url(url) as r:
        names = list(r.scan_iter(f"tg:idem:*:{key}"))
        assert len(names) == 1, names
        rec = json.loads(r.get(names[0]))
        assert rec["state"] == "running", rec
        rec["lease"] = 0
        r.set(names[0], json.dumps(rec), px=r.pttl(names[0]))
