"""A ledger read the database cannot answer now (SQLite's file locked, PostgreSQL down or a read cancelled at its
statement timeout, quotas/ledger_reads.py READ_TIMEOUT_S) is a retryable 503 `ledger_unavailable` in OpenAI's shape,
with Retry-After and a fixed sentence, for a usage report (an admin's or a tenant's) and /admin/ops alike. It was a
500 "internal error". The driver's words go to the log, once an outage, then one line when reads work again."""

from __future__ import annotations

import asyncio
import logging
import pickle
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

from gateway.errors import Unavailable
from gateway.report_gate import LEDGER_READ_MESSAGE, ReportGate
from quotas import ledger_postgres
from quotas.ledger_postgres import PostgresLedger
from quotas.ledger_reads import read_fault
from tests.conftest import Gateway
from tests.quotas.test_ledger import row

ROUTES = [("admin", "/admin/ops"), ("admin", "/admin/usage/report"), ("tenant", "/v1/usage")]


def database_is_locked(tmp_path: Path) -> sqlite3.OperationalError:
    """SQLite's own 'database is locked' (a read while another connection holds the file exclusively), as it comes
    back from a report process: pickled."""
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (a)")
    holder.execute("BEGIN EXCLUSIVE")
    reader = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        reader.execute("SELECT * FROM t")
    except sqlite3.OperationalError as exc:
        return pickle.loads(pickle.dumps(exc))  # type: ignore[no-any-return]
    finally:
        reader.close()
        holder.close()
    raise AssertionError("the read was not refused")


def test_a_ledger_read_that_fails_for_now_is_a_503_ledger_unavailable(
        gateway: Gateway, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    locked = database_is_locked(tmp_path)
    assert "locked" in str(locked)
    services = gateway.app.state.services
    failing = True
    real_latencies, real_report = services.ledger.latencies, services.reports.processes.report

    def latencies(**kwargs: Any) -> Any:  # /admin/ops' read, on its thread
        if failing:
            raise locked
        return real_latencies(**kwargs)

    def report(*args: Any, **kwargs: Any) -> Any:  # what a report process sends back, raised on the report thread
        if failing:
            raise locked
        return real_report(*args, **kwargs)

    services.ledger.latencies, services.reports.processes.report = latencies, report
    keys = {"admin": gateway.admin_key, "tenant": gateway.tenant_key}
    caplog.set_level(logging.INFO, logger="tiergate.report")
    for who, path in ROUTES:
        with gateway.client(keys[who]) as c:
            r = c.get(path)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["error"] == {"message": LEDGER_READ_MESSAGE, "type": "service_unavailable", "param": None,
                                     "code": "ledger_unavailable"}
        assert int(r.headers["retry-after"]) > 0
        assert "locked" not in r.text and "OperationalError" not in r.text
    failing = False
    for who, path in ROUTES:
        with gateway.client(keys[who]) as c:
            assert c.get(path).status_code == 200, path
    logged = [r.getMessage() for r in caplog.records if r.name == "tiergate.report"]
    assert len(logged) == 2, logged  # the fault once for three reads, then reads work again
    assert "database is locked" in logged[0]
    assert logged[1].endswith("recovered after 3 failed reads")


def test_a_postgres_read_cancelled_at_its_statement_timeout_is_unavailable(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger_postgres, "READ_TIMEOUT_S", 0.3, raising=False)
    ledger = PostgresLedger(database_url, max_read_connections=1)
    gate = ReportGate(threads=1)
    ledger.record_now([row(1)])
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")  # an operator's lock: the read waits on it
        with pytest.raises(Unavailable) as err:
            asyncio.run(gate.read(asyncio.to_thread(ledger.rows)))
        blocker.rollback()
        assert err.value.code == "ledger_unavailable" and err.value.retry_after
        assert isinstance(err.value.__context__, psycopg.errors.QueryCanceled)  # cancelled at the bound, then told
        assert [r.request_id for r in asyncio.run(gate.read(asyncio.to_thread(ledger.rows)))] == ["r1"]
    finally:
        blocker.close()
        gate.close()
        ledger.close()


def test_a_bug_in_a_read_is_not_told_as_the_database_being_down() -> None:
    conn = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as sql_error:
        conn.execute("SELECT * FROM no_such_table")
    assert not read_fault(pickle.loads(pickle.dumps(sql_error.value)))  # an SQL error: a bug, a 500
    assert not read_fault(psycopg.errors.UndefinedTable("relation does not exist"))
    assert not read_fault(ValueError("cannot group by 'x'"))
    assert read_fault(psycopg.OperationalError("connection refused"))
