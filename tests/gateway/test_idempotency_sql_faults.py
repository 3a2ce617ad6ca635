"""Idempotency-Key claims through HTTP when the SQL store fails: SQLite busy past its timeout, or its file damaged, is a
retryable 503 `idempotency_unavailable` that runs and charges nothing (each was a 500), and a PostgreSQL claim whose
reply was lost after it committed is the request's own: it is answered and charged once, and the SDK's retry replays
it (it was a 503, then a 409 for the lease). Faults are real: a connection holding SQLite's write lock, the file's key
index overwritten, and a TCP proxy in front of PostgreSQL that cuts the claim's reply
(tests/quotas/test_idempotency_sql_faults.py, tests/quotas/test_idempotency_sqlite_faults.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import time

from gateway.settings import Settings
from tests.conftest import running_gateway
from tests.pg_proxy import PgProxy
from tests.quotas.test_idempotency_sql_faults import CLAIM
from tests.quotas.test_idempotency_sqlite_faults import damage_key_index
from tests.stubs import ServerThread, StubState

MSG = [{"role": "user", "content": "hello there"}]


def test_sqlite_busy_claim_is_a_retryable_503_that_runs_and_charges_nothing(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    with running_gateway(gateway_settings, stub[1]) as gw:
        store = gw.app.state.services.pipeline.idempotency.store
        store._busy_s = 0.05  # its 5 s, shorter
        writer = sqlite3.connect(gw.settings.ledger_db, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")  # the write lock held past the claim's timeout
        with gw.client(gw.tenant_key) as c:
            try:
                r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                           headers={"idempotency-key": "order-1"})
            finally:
                writer.execute("ROLLBACK")
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "idempotency_unavailable" and error["param"] == "Idempotency-Key"
            assert int(r.headers["retry-after"]) >= 1
            assert gw.stub.requests == []  # nothing run
            deadline = time.monotonic() + 15  # the lock is free: the retry with the key runs, once
            while (r := c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                               headers={"idempotency-key": "order-1"})).status_code != 200:
                assert r.status_code == 503 and time.monotonic() < deadline, r.text
                time.sleep(0.2)
        assert len(gw.stub.requests) == 1 and len(gw.ledger_rows()) == 1


def test_a_damaged_sqlite_file_is_a_retryable_503_that_runs_nothing_and_requests_without_a_key_still_run(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    gateway_settings.data_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(damage_key_index(gateway_settings.ledger_db))  # the ledger's file, its idempotency key index damaged
    with running_gateway(gateway_settings, stub[1]) as gw, gw.client(gw.tenant_key) as c:
        for _ in range(2):  # the SDK's retry too: a damaged file does not mend, nor does it become a 500
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                       headers={"idempotency-key": "order-1"})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "idempotency_unavailable" and error["param"] == "Idempotency-Key"
            assert int(r.headers["retry-after"]) >= 1
        assert gw.stub.requests == [] and gw.ledger_rows() == []  # nothing run or charged
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
        assert r.status_code == 200, r.text
        assert len(gw.stub.requests) == 1 and len(gw.ledger_rows()) == 1


def test_a_postgresql_claim_whose_reply_was_lost_is_answered_and_charged_once(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], database_url: str,
        pg_proxy: PgProxy) -> None:
    settings = gateway_settings.model_copy(update={"database_url": pg_proxy.url(database_url)})
    with running_gateway(settings, stub[1]) as gw, gw.client(gw.tenant_key) as c:
        pg_proxy.lose = CLAIM
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                   headers={"idempotency-key": "order-1"})
        assert pg_proxy.lost == 1
        assert r.status_code == 200, r.text
        again = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                       headers={"idempotency-key": "order-1"})  # the SDK's retry: the answer, not a 409
        assert again.status_code == 200, again.text
        assert again.headers["x-tiergate-idempotent-replay"] == "true" and again.json()["id"] == r.json()["id"]
        assert len(gw.stub.requests) == 1 and len(gw.ledger_rows()) == 1  # run and charged once
