"""/admin/ops' window (`LedgerReads.latencies`: one statement over `requests WHERE ts >= ?`) is read from an index
alone: requests_ts_window, (ts) with the columns the statement reads (ttft_s, total_s, http_status). It was found by
requests_ts and each row fetched from the table (every column of 200k rows for four of them). Both ledgers: SQLite
makes it at every open, a ledger from before too; PostgreSQL's migration 9 builds it (ts, INCLUDE the others)."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg

from quotas.ledger import Ledger
from quotas.ledger_reads import LedgerReads
from tests.postgres import LedgerStore
from tests.quotas.test_ledger import row


def window_read(ledger: LedgerReads) -> tuple[str, tuple[Any, ...]]:
    """The statement `latencies` runs and its arguments, as the ledger sends them."""
    sent: list[tuple[str, tuple[Any, ...]]] = []
    query = ledger._query

    def kept(sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        sent.append((sql, args))
        return query(sql, args)

    ledger._query = kept  # type: ignore[method-assign]
    try:
        ledger.latencies(since=1000.0, quantiles=(0.5, 0.99))
    finally:
        del ledger._query  # type: ignore[method-assign]
    (one,) = sent
    return one


def plan(ledger_store: LedgerStore, sql: str, args: tuple[Any, ...]) -> str:
    """How the database runs `sql`; PostgreSQL's table vacuumed (its visibility map: what an index-only scan needs) and
    told to use an index where it has one (the table is small)."""
    if ledger_store.kind == "sqlite":
        with sqlite3.connect(ledger_store.target) as conn:
            return "\n".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, args))
    with psycopg.connect(ledger_store.target, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE requests")
        conn.execute("SET enable_seqscan = off")
        conn.execute("SET enable_bitmapscan = off")
        return "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql.replace("?", "%s"), args))


def test_the_ops_window_is_read_from_its_covering_index(ledger_store: LedgerStore) -> None:
    ledger = ledger_store.open()
    ledger.record_now([replace(row(i), ts=900.0 + i, http_status=(200, 503)[i % 2]) for i in range(300)])
    sql, args = window_read(ledger)
    got = ledger.latencies(since=1000.0, quantiles=(0.5,))
    ledger.close()
    assert (got.requests, got.errors) == (200, 100)
    how = plan(ledger_store, sql, args)
    if ledger_store.kind == "sqlite":
        assert "USING COVERING INDEX requests_ts_window (ts>?)" in how, how
    else:
        assert "Index Only Scan using requests_ts_window on requests" in how, how


def test_a_ledger_from_before_gets_the_window_index_when_opened(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    Ledger(db).close()
    with sqlite3.connect(db) as conn:  # as the release before left it
        conn.execute("DROP INDEX IF EXISTS requests_ts_window")
    Ledger(db).close()
    with sqlite3.connect(db) as conn:
        (found,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'requests_ts_window'").fetchone()
    assert found == "CREATE INDEX requests_ts_window ON requests(ts, ttft_s, total_s, http_status)"
