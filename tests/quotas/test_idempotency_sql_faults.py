"""Idempotency-Key claims on SQLite and PostgreSQL when the database fails: a claim it cannot take now (SQLite busy
past its timeout or out of disk; PostgreSQL read-only, timed out, or unreachable) is `LedgerUnavailable` (a retryable
503 at the gateway) with nothing claimed, and a bug is still raised as it is. A PostgreSQL claim the server refused
(rolled back) is not sent again; one whose reply was lost after it committed is the request's own claim when sent
again, and one the database cannot confirm is given up once it answers, so the client's retry runs (once) instead of
waiting out the lease. Faults are real: a connection holding SQLite's write lock, SQLite's page limit, a read-only
database, a lock held past PostgreSQL's statement timeout, and a TCP proxy that cuts PostgreSQL's reply
(tests/quotas/test_idempotency_sqlite_faults.py has SQLite's damaged file and memory)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from quotas.idempotency import Claim, Running
from quotas.idempotency_postgres import PostgresIdempotency
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import LedgerUnavailable
from tests.pg_proxy import PgProxy
from tests.postgres import PostgresServer

CLAIM = b"WITH claimed AS"  # the text of PostgreSQL's claim statement (quotas/idempotency_postgres.py's _PG_BEGIN)


Keep = Callable[[Any], Any]


@pytest.fixture
async def closing() -> AsyncIterator[Keep]:
    """Stores closed after the test, passed or not (an open pool would outlive the test's event loop)."""
    stores: list[Any] = []
    yield lambda store: stores.append(store) or store
    for store in stores:
        await store.close()


def records(database_url: str) -> list[tuple[str, str, str]]:
    """The idempotency records (key, owner, state), read beside the store (not through the proxy)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT key, owner, state FROM idempotency ORDER BY key").fetchall()


async def test_sqlite_busy_past_its_timeout_is_unavailable_and_claims_nothing(closing: Keep, tmp_path: Path) -> None:
    store = closing(SQLiteIdempotency(tmp_path / "ledger.db"))
    store._conn.execute("PRAGMA busy_timeout = 50")  # its 5 s, shorter
    writer = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # the ledger's writer holding the write lock past the timeout
    with pytest.raises(LedgerUnavailable, match="locked"):
        await store.begin("acme", "k1", "body", "r1", lease_s=60)
    writer.execute("ROLLBACK")
    assert await store.begin("acme", "k1", "body", "r2", lease_s=60) == Claim("acme", "k1", "body", "r2")


async def test_sqlite_out_of_disk_is_unavailable_and_its_claim_rolled_back(closing: Keep, tmp_path: Path) -> None:
    store = closing(SQLiteIdempotency(tmp_path / "ledger.db"))
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")  # a full disk: no page more
    for n in range(10_000):
        try:
            await store.begin("acme", f"k{n}", "body", f"r{n}", lease_s=60)
        except LedgerUnavailable as exc:
            assert "full" in str(exc)
            break
    else:
        raise AssertionError("the page limit was never reached")
    held = store._conn.execute("SELECT records FROM idempotency_tenants WHERE tenant = 'acme'").fetchone()
    assert held == (n,) and store._conn.execute("SELECT count(*) FROM idempotency").fetchone() == (n,)
    store._conn.execute("PRAGMA max_page_count = 1073741823")  # room again: the refused key is claimed by its retry
    assert await store.begin("acme", f"k{n}", "body", "retry", lease_s=60) == Claim("acme", f"k{n}", "body", "retry")


async def test_a_bug_in_a_claim_is_still_raised_as_it_is(closing: Keep, tmp_path: Path, database_url: str) -> None:
    lite = closing(SQLiteIdempotency(tmp_path / "ledger.db"))
    lite._conn.execute("DROP TABLE idempotency_tenants")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        await lite.begin("acme", "k1", "body", "r1", lease_s=60)
    pg = closing(PostgresIdempotency(database_url, timeout_s=1.0))
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE idempotency_tenants CASCADE")
    with pytest.raises(psycopg.errors.UndefinedTable):
        await pg.begin("acme", "k1", "body", "r1", lease_s=60)


async def test_a_read_only_postgresql_is_unavailable_and_claims_nothing(
        closing: Keep, postgres_server: PostgresServer, database_url: str) -> None:
    store = closing(PostgresIdempotency(database_url, timeout_s=1.0))  # its schema made; its pool opens at its claim

    def read_only(on: bool) -> None:  # a standby, or a primary a failover demoted
        with psycopg.connect(postgres_server.url(), autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {database_url.rsplit('/', 1)[1]} SET default_transaction_read_only = "
                         f"{'on' if on else 'off'}")

    read_only(True)
    with pytest.raises(LedgerUnavailable, match="read-only"):
        await store.begin("acme", "k1", "body", "r1", lease_s=60)
    read_only(False)
    assert records(database_url) == []
    store = closing(PostgresIdempotency(database_url, timeout_s=1.0))
    assert await store.begin("acme", "k1", "body", "r2", lease_s=60) == Claim("acme", "k1", "body", "r2")


async def test_a_claim_whose_reply_was_lost_is_its_requests_own_claim(closing: Keep, database_url: str,
                                                                       pg_proxy: PgProxy) -> None:
    store = closing(PostgresIdempotency(pg_proxy.url(database_url), timeout_s=1.0))
    pg_proxy.lose = CLAIM
    assert await store.begin("acme", "k1", "body", "r1", lease_s=600) == Claim("acme", "k1", "body", "r1")
    assert pg_proxy.lost == 1 and records(database_url) == [("k1", "r1", "running")]
    # the claim is r1's alone: another request with the key still waits for it
    assert await store.begin("acme", "k1", "body", "r2", lease_s=600) == Running()


async def test_a_lost_claim_the_database_cannot_confirm_is_given_up_once_it_answers(
        closing: Keep, database_url: str, pg_proxy: PgProxy) -> None:
    store = closing(PostgresIdempotency(pg_proxy.url(database_url), timeout_s=0.5))
    await store.begin("acme", "warm", "body", "r0", lease_s=600)  # the pool opened
    pg_proxy.lose, pg_proxy.then_down = CLAIM, True
    with pytest.raises(LedgerUnavailable):  # a 503: r1 does not run
        await store.begin("acme", "k1", "body", "r1", lease_s=600)
    assert pg_proxy.lost == 1 and ("k1", "r1", "running") in records(database_url)  # committed, its reply lost
    pg_proxy.up()
    deadline = time.monotonic() + 10  # the gateway's wait for a running key
    while True:
        try:  # the pool reconnects first: meanwhile a claim is a 503 the client retries, as the gateway answers it
            begun = await store.begin("acme", "k1", "body", "r2", lease_s=600)
        except LedgerUnavailable:
            begun = Running()
        if begun != Running():
            break
        assert time.monotonic() < deadline, "the lost claim still holds the key"
        await asyncio.sleep(0.1)
    assert begun == Claim("acme", "k1", "body", "r2")  # the client's retry runs, once
    assert ("k1", "r2", "running") in records(database_url)


async def test_a_claim_the_server_refused_is_not_sent_again_nor_given_up(closing: Keep, database_url: str,
                                                                         pg_proxy: PgProxy) -> None:
    """A statement timeout (the tenant's totals row, which a claim of a new key locks, held past it): the server rolled
    the claim back, so it is a 503 at once, not after a second timeout (it was sent again), and no give-up is owed."""
    store = closing(PostgresIdempotency(pg_proxy.url(database_url), timeout_s=1.0))  # its schema made; its pool opens
    with psycopg.connect(database_url, autocommit=True) as conn:  # at its first claim, with the database's settings
        conn.execute(f"ALTER DATABASE {database_url.rsplit('/', 1)[1]} SET statement_timeout = '1s'")
    await store.begin("acme", "warm", "body", "r0", lease_s=600)  # the pool opened, the tenant's totals row made
    pg_proxy.count = CLAIM
    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT * FROM idempotency_tenants WHERE tenant = 'acme' FOR UPDATE")
        with pytest.raises(LedgerUnavailable, match="statement timeout"):
            await store.begin("acme", "k1", "body", "r1", lease_s=600)
        holder.execute("ROLLBACK")
    assert pg_proxy.counted == 1  # sent once
    assert len(store._give_ups) == 0 and records(database_url) == [("warm", "r0", "running")]
    assert await store.begin("acme", "k1", "body", "r2", lease_s=600) == Claim("acme", "k1", "body", "r2")


async def test_a_claim_waiting_on_a_lock_another_session_holds_is_unavailable_in_bounded_time(
        closing: Keep, database_url: str) -> None:
    """Another session holds the records' table (an operator's LOCK TABLE, a long ALTER): a claim waited for it without
    end, its request (and a pooled connection) held; the pool's statement timeout makes it a retryable 503."""
    store = closing(PostgresIdempotency(database_url, timeout_s=0.3))
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE idempotency IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(LedgerUnavailable, match="statement timeout"):
            await asyncio.wait_for(store.begin("acme", "k1", "fp", "r1", lease_s=60), 10)
        blocker.rollback()
        assert isinstance(await store.begin("acme", "k1", "fp", "r1", lease_s=60), Claim)  # and then it claims
    finally:
        blocker.close()
