"""The fleet database's migrations: a database made by the previous release is upgraded in place with its
data kept, replicas starting together migrate once, and a database newer than the code is left alone."""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal

import psycopg

from quotas.fleet_db import connect, migrate, version_of
from quotas.idempotency import Claim, PostgresIdempotency, Replay
from quotas.ledger_postgres import COMPONENT, MIGRATIONS, PostgresLedger, open_schema
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
        assert version_of(conn, COMPONENT) == len(MIGRATIONS) == 4


def test_replicas_starting_together_apply_each_migration_once(database_url: str) -> None:
    versions: list[int] = []
    threads = [threading.Thread(target=lambda: versions.append(open_schema(database_url))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert versions == [4] * 6
    with connect(database_url) as conn:
        applied = conn.execute("SELECT version FROM tiergate_migrations WHERE component = 'ledger' "
                               "ORDER BY version").fetchall()
    assert applied == [(1,), (2,), (3,), (4,)]


def test_a_database_newer_than_this_release_is_left_as_it_is(database_url: str) -> None:
    with connect(database_url) as conn:
        newer = [*MIGRATIONS, "ALTER TABLE requests ADD COLUMN region TEXT NOT NULL DEFAULT 'eu'"]
        assert migrate(conn, COMPONENT, newer) == 5  # a replica of the next release got there first
        assert migrate(conn, COMPONENT, MIGRATIONS) == 5  # one of this release starts: nothing undone, no error
    ledger = PostgresLedger(database_url)
    ledger.record_now([row(1)])
    assert [r.request_id for r in ledger.rows()] == ["r1"]
    ledger.close()
