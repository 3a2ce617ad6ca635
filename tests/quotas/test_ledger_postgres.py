"""The ledger on PostgreSQL under faults: a bad row fails only itself, a locked table or a stopped server makes
the ledger not ready with every pending row kept, and writing resumes when the database is back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors as pg_errors

from quotas.ledger import LedgerUnavailable
from quotas.ledger_postgres import PostgresLedger
from tests.pg_proxy import PgProxy
from tests.postgres import PostgresServer
from tests.quotas.test_ledger import row


async def test_a_bad_row_fails_only_itself_and_the_writer_goes_on(database_url: str) -> None:
    ledger = PostgresLedger(database_url)
    ledger.record_now([row(0)])
    huge = row(1)
    huge.input_tokens = 2**70  # more than a BIGINT holds
    good = [row(i) for i in range(2, 40)]
    futures = [ledger.submit(r) for r in [*good[:10], huge, row(0), *good[10:]]]  # one group commit
    ledger.start()
    results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
    assert isinstance(results[10], pg_errors.DataError)
    assert isinstance(results[11], pg_errors.UniqueViolation)  # the duplicate request id
    assert [r for i, r in enumerate(results) if i not in (10, 11)] == [None] * len(good)
    await ledger.record(row(99))
    assert ledger.ready
    assert {r.request_id for r in ledger.rows()} == {"r0", "r99"} | {r.request_id for r in good}
    assert ledger.get("r0").input_tokens == 10  # type: ignore[union-attr]
    ledger.close()


async def test_a_locked_table_times_out_record_and_makes_the_ledger_not_ready(database_url: str) -> None:
    ledger = PostgresLedger(database_url, busy_timeout_s=0.1)
    ledger.start()
    await ledger.record(row(0))
    blocker = psycopg.connect(database_url)  # another session holds the table past the writer's statement timeout
    blocker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
    with pytest.raises(LedgerUnavailable, match="statement timeout"):
        await ledger.record(row(1), timeout_s=0.5)
    assert not ledger.ready and "QueryCanceled" in ledger.not_ready_reason  # type: ignore[operator]
    late = ledger.submit(row(2))
    blocker.rollback()
    await ledger.wait_durable(late)
    assert ledger.ready
    assert sorted(r.request_id for r in ledger.rows()) == ["r0", "r1", "r2"]  # the timed-out row was kept
    blocker.close()
    ledger.close()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of the test's own, which it may stop and start again."""
    server = PostgresServer().start()
    yield server
    server.stop()


async def test_a_stopped_server_keeps_every_row_until_it_is_back(own_postgres: PostgresServer) -> None:
    url = own_postgres.create_database()
    ledger = PostgresLedger(url, record_timeout_s=1.0)
    ledger.start()
    await ledger.record(row(0))
    own_postgres.stop(keep=True)
    pending = [ledger.submit(row(i)) for i in range(1, 50)]
    with pytest.raises(LedgerUnavailable):
        await ledger.wait_durable(pending[0])
    assert not ledger.ready  # the gateway refuses new work rather than serve unbilled
    assert not any(f.done() for f in pending)
    own_postgres.start()
    await asyncio.wait_for(asyncio.gather(*pending), 15)
    assert ledger.ready
    assert {r.request_id for r in ledger.rows()} == {f"r{i}" for i in range(50)}
    ledger.close()


def test_rows_are_streamed_a_batch_at_a_time_in_their_order(database_url: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.quotas.test_report import batches_read

    ledger = PostgresLedger(database_url)
    ledger.record_now([row(i) for i in range(7)])
    whole = [r.request_id for r in ledger.rows()]
    sizes = batches_read(ledger, monkeypatch, 3)
    assert [r.request_id for r in ledger.each_row()] == whole and len(whole) == 7
    assert sizes == [3, 3, 1]
    rows = ledger.each_row()
    assert next(rows).request_id == whole[0]
    with psycopg.connect(database_url, autocommit=True) as other:  # the server holds the rest, behind a cursor
        (fetching,) = other.execute("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
                                    "AND query LIKE 'FETCH FORWARD 3 FROM %tiergate_read_%'").fetchone()
    assert fetching == 1
    rows.close()
    ledger.close()


def test_refusal_counts_are_added_to_in_key_order_so_two_replicas_never_deadlock(database_url: str) -> None:
    """Another replica's commit holds the count row of the first key (in key order) and then wants the second: this
    ledger's commit, whose refusals came in the other order, must wait for the first before it takes the second,
    or the two deadlock (the other replica's second upsert would wait on it)."""
    from quotas.ledger_rows import Refusal

    ledger = PostgresLedger(database_url)
    minute = 1_800_000_000 - 1_800_000_000 % 60
    first, second = ("acme-lock", "a-first"), ("acme-lock", "b-second")  # (tenant, reason), in key order
    other = psycopg.connect(database_url)
    try:
        other.execute("SET lock_timeout = '2s'")
        upsert = ("INSERT INTO refusal_counts VALUES (%s, %s, 'k', %s, 429, 1) ON CONFLICT "
                  "(minute, tenant, key_id, reason, http_status) DO UPDATE SET count = refusal_counts.count + 1")
        other.execute(upsert, (minute, *first))  # the other replica's commit holds the first row ...
        came = [Refusal(f"r{i}", minute + 1, tenant, "k", reason, 429)
                for i, (tenant, reason) in enumerate([second, first])]  # ... this one's refusals came second-first
        writer = threading.Thread(target=ledger.record_now, args=([], came))
        writer.start()
        time.sleep(0.5)  # this commit is waiting now: for the first row if it keeps key order, else holding the second
        other.execute(upsert, (minute, *second))  # the other replica's next row (LockNotAvailable if held)
        other.commit()
        writer.join(10)
        assert not writer.is_alive()
        counts = dict(other.execute("SELECT reason, count FROM refusal_counts WHERE tenant = 'acme-lock'").fetchall())
        assert counts == {"a-first": 2, "b-second": 2}
    finally:
        other.close()
        ledger.close()


async def test_a_group_commit_whose_reply_was_lost_is_written_once_and_its_waiters_told_it_is_durable(
        pg_proxy: PgProxy, database_url: str) -> None:
    """The server commits a group, and the connection is cut as its reply comes: the writer cannot tell from the
    error whether it landed. Sent again, its rows were refused as duplicates of themselves (each waiter told its row
    was refused, a 500 for an answer that is billed) and its refusal counts added twice; the writer asks the server
    what became of the transaction instead."""
    from quotas.ledger_rows import Refusal

    ledger = PostgresLedger(pg_proxy.url(database_url))
    written = [ledger.submit(row(i)) for i in range(3)]
    await asyncio.sleep(0)  # queued: one group with the refusal
    ledger.submit_refusal(Refusal("x0", 1_800_000_000, "acme", "k", "rpm", 429))
    pg_proxy.lose = b"COMMIT"  # the group's commit: its migrations are committed already
    ledger.start()
    try:
        assert await asyncio.wait_for(asyncio.gather(*written, return_exceptions=True), 10) == [None] * 3
        assert pg_proxy.lost == 1
        await ledger.record(row(3))  # the writer goes on, ready
        assert ledger.ready
        with psycopg.connect(database_url, autocommit=True) as conn:
            assert conn.execute("SELECT request_id FROM requests ORDER BY 1").fetchall() == [("r0",), ("r1",), ("r2",),
                                                                                           ("r3",)]
            assert conn.execute("SELECT sum(count) FROM refusal_counts").fetchone() == (1,)
    finally:
        ledger.close()
