"""The fleet database's migrations: a database made by the previous release is upgraded in place with its
data kept, replicas starting together migrate once, and a database newer than the code is left alone."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from quotas.fleet_db import connect, migrate, version_of
from quotas.idempotency import Claim, Replay
from quotas.idempotency_postgres import PostgresIdempotency
from quotas.ledger_postgres import COMPONENT, MIGRATIONS, UPSERT_COUNT, PostgresLedger, open_schema
from quotas.ledger_rows import COLUMNS, to_db
from tests.quotas.test_ledger import row


def test_a_ledger_of_the_previous_release_is_upgraded_in_place_with_its_rows(database_url: str) -> None:
    assert open_schema(database_url, upto=1) == 1  # the previous release's schema: no idempotency records
    first = COLUMNS[:COLUMNS.index("cascade_of") + 1]  # the columns of that release
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"INSERT INTO requests({', '.join(first)}) VALUES ({', '.join('%s' for _ in first)})",
                     to_db(row(1, price="0.25"))[:len(first)])
        conn.execute("INSERT INTO refusal_counts VALUES (1800000000, 'acme', 'k', 'rate_limit_rpm', 429, 7)")
        assert conn.execute("SELECT to_regclass('idempotency')").fetchone() == (None,)

    async def serve_with_the_new_release() -> None:
        ledger = PostgresLedger(database_url)  # what a replica of the new release does at start
        store = PostgresIdempotency(database_url)
        ledger.start()
        claim = await store.begin("acme", "order-1", "fp", "r2", lease_s=60)
        assert isinstance(claim, Claim)
        await ledger.wait_durable(ledger.submit(row(2), with_row=store.finish_with_row(claim, {"a": 1}, 3600)))
        assert await store.begin("acme", "order-1", "fp", "r3", lease_s=60) == Replay({"a": 1})
        assert [(r.request_id, r.price_usd) for r in ledger.rows()] == [("r1", Decimal("0.25")),
                                                                         ("r2", Decimal("0.000001"))]
        assert sum(c.count for c in ledger.refusal_counts()) == 7
        await store.close()
        ledger.close()

    asyncio.run(serve_with_the_new_release())
    with connect(database_url) as conn:
        assert version_of(conn, COMPONENT) == len(MIGRATIONS) == 8


def test_replicas_starting_together_apply_each_migration_once(database_url: str) -> None:
    versions: list[int] = []
    threads = [threading.Thread(target=lambda: versions.append(open_schema(database_url))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert versions == [8] * 6
    with connect(database_url) as conn:
        applied = conn.execute("SELECT version FROM tiergate_migrations WHERE component = 'ledger' "
                               "ORDER BY version").fetchall()
    assert applied == [(v,) for v in range(1, 9)]


def test_a_database_newer_than_this_release_is_left_as_it_is(database_url: str) -> None:
    with connect(database_url) as conn:
        newer = [*MIGRATIONS, "ALTER TABLE requests ADD COLUMN region TEXT NOT NULL DEFAULT 'eu'"]
        assert migrate(conn, COMPONENT, newer) == 9  # a replica of the next release got there first
        assert migrate(conn, COMPONENT, MIGRATIONS) == 9  # one of this release starts: nothing undone, no error
    ledger = PostgresLedger(database_url)
    ledger.record_now([row(1)])
    assert [r.request_id for r in ledger.rows()] == ["r1"]
    ledger.close()


def index_of(conn: psycopg.Connection[Any], name: str) -> tuple[Any, ...] | None:
    return conn.execute("SELECT indisvalid, pg_get_indexdef(indexrelid) FROM pg_index WHERE indexrelid = "
                        "to_regclass(%s)", (name,)).fetchone()


BUILT = (True, "CREATE INDEX refusal_counts_tenant_minute ON public.refusal_counts USING btree (tenant, minute)")


def test_an_index_left_invalid_by_an_interrupted_build_is_built_again(database_url: str) -> None:
    """A replica died (or was cancelled) while it built the index concurrently: PostgreSQL keeps an INVALID index of
    that name, which no query uses and CREATE INDEX IF NOT EXISTS would take as built. The next start drops it and
    builds it again; a start after that has nothing to do."""
    open_schema(database_url, upto=3)
    with connect(database_url) as conn:
        conn.execute("INSERT INTO refusal_counts VALUES (1, 'acme', 'k', 'a', 429, 1), (1, 'acme', 'k', 'b', 429, 1)")
        with pytest.raises(psycopg.errors.UniqueViolation):  # a build that fails half-way, as an interrupted one
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY refusal_counts_tenant_minute ON refusal_counts(tenant, "
                         "minute)")
        assert index_of(conn, "refusal_counts_tenant_minute")[0] is False  # type: ignore[index]
    assert open_schema(database_url) == len(MIGRATIONS)
    assert open_schema(database_url) == len(MIGRATIONS)
    with connect(database_url) as conn:
        assert index_of(conn, "refusal_counts_tenant_minute") == BUILT
        assert conn.execute("SELECT count(*) FROM tiergate_migrations WHERE component = 'ledger' AND version = 4"
                            ).fetchone() == (1,)


def test_refusal_counts_are_written_while_the_index_builds(database_url: str) -> None:
    """Migration 4 on a database with a long refusal_counts: the build must not hold up the gateway's writes of
    refusal counts (a CREATE INDEX in the migration's transaction did: every write queued behind its lock until it
    committed). A transaction left open on the table keeps the build in progress (it waits for it) for as long as
    the test needs; a count written meanwhile is not held up; a second replica starting meanwhile waits its turn
    (polling the lock: had it waited in a statement, the build would wait for that statement's snapshot, and it
    for the build's lock, a deadlock), and both end with the index built once."""
    open_schema(database_url, upto=3)
    holder = psycopg.connect(database_url)  # not autocommit: its transaction stays open
    holder.execute("INSERT INTO refusal_counts VALUES (1, 'acme', 'k', 'held', 429, 1)")
    with ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(open_schema, database_url)
            with connect(database_url) as conn:
                for _ in range(250):  # until the build waits for the open transaction
                    building = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                            "AND query ILIKE '%CREATE INDEX%'").fetchone()
                    if building == (1,):
                        break
                    time.sleep(0.02)
                assert building == (1,)
                second = pool.submit(open_schema, database_url)
                conn.execute("SET statement_timeout = '3s'")
                conn.execute(UPSERT_COUNT, (2, "acme", "k", "rate_limit_rpm", 429, 1))  # the ledger's write
                assert conn.execute("SELECT count FROM refusal_counts WHERE minute = 2").fetchone() == (1,)
                time.sleep(0.3)
                assert not first.done() and not second.done()
            holder.commit()
        finally:
            holder.close()  # the build goes on (its transaction rolled back, if the test failed)
        assert first.result(timeout=60) == second.result(timeout=60) == len(MIGRATIONS)
    with connect(database_url) as conn:
        assert index_of(conn, "refusal_counts_tenant_minute") == BUILT
        assert conn.execute("SELECT version, count(*) FROM tiergate_migrations WHERE component = 'ledger' GROUP BY "
                            "version ORDER BY version").fetchall() == [(v, 1) for v in range(1, len(MIGRATIONS) + 1)]


def test_a_ledger_of_the_release_before_gains_the_fallback_mark_in_place(database_url: str) -> None:
    """Migrations 6 to 8 on a database of version 5 with rows: they stay unmarked (nothing to apply), and rows
    settled on a quota fallback from now on are found until noted applied, by any replica."""
    assert open_schema(database_url, upto=5) == 5
    first = COLUMNS[:COLUMNS.index("model_version") + 1]  # the columns of that release
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"INSERT INTO requests({', '.join(first)}) VALUES ({', '.join('%s' for _ in first)})",
                     to_db(row(1, price="0.25"))[:len(first)])
    ledger = PostgresLedger(database_url)
    other = PostgresLedger(database_url)  # another replica of the fleet
    try:
        marked = row(2, price="0.5")
        marked.fallback = "sum:20261205:t,k:k"
        ledger.record_now([marked])
        assert [r.fallback for r in ledger.rows()] == [None, "sum:20261205:t,k:k"]
        assert other.fallback_pending(0, 10) == [("r2", "acme", Decimal("0.5"), "sum:20261205:t,k:k")]
        other.mark_fallback_applied(["r2"])
        ledger.mark_fallback_applied(["r2"])  # a repeat changes nothing
        assert ledger.fallback_pending(0, 10) == []
    finally:
        ledger.close()
        other.close()
    with connect(database_url) as conn:
        assert version_of(conn, COMPONENT) == 8
        assert index_of(conn, "requests_fallback")[0] is True  # type: ignore[index]


def test_a_ledger_of_the_release_before_carries_its_pending_fallback_rows_over(database_url: str) -> None:
    """Migration 8 on a database of version 7: its marked rows not noted applied are pending, the others not; a row
    noted applied leaves the list, and a replica of the release before (which writes rows and notes them as before)
    keeps the list too."""
    assert open_schema(database_url, upto=7) == 7
    insert = f"INSERT INTO requests({', '.join(COLUMNS)}) VALUES ({', '.join('%s' for _ in COLUMNS)})"
    rows = {i: row(i, price="0.5") for i in range(1, 4)}
    for r in rows.values():
        r.fallback = "sum:20261205:t"
    with psycopg.connect(database_url, autocommit=True) as conn:
        for r in rows.values():
            conn.execute(insert, to_db(r))
        conn.execute("INSERT INTO fallback_applied VALUES ('r1')")
    ledger = PostgresLedger(database_url)
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            assert conn.execute("SELECT request_id FROM fallback_pending ORDER BY 1").fetchall() == [("r2",), ("r3",)]
            assert [p[0] for p in ledger.fallback_pending(0, 10)] == ["r2", "r3"]
            ledger.mark_fallback_applied(["r2"])
            conn.execute("INSERT INTO fallback_applied VALUES ('r3') ON CONFLICT DO NOTHING")  # the release before's
            later = row(4, price="0.5")
            later.fallback = "sum:20261205:t"
            conn.execute(insert, to_db(later))  # ...and its row
            assert conn.execute("SELECT request_id FROM fallback_pending").fetchall() == [("r4",)]
            assert [p[0] for p in ledger.fallback_pending(0, 10)] == ["r4"]
    finally:
        ledger.close()
