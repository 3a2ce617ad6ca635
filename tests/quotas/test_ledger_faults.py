"""The ledger writer under faults: a bad row fails only itself, `record` times out, and a locked database or a
full disk makes the ledger not ready until it can commit again, with no row lost."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from quotas.ledger import Ledger, LedgerUnavailable
from tests.quotas.test_ledger import row


async def test_a_bad_row_fails_only_itself_and_the_writer_goes_on(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.record_now([row(0)])
    huge = row(1)
    huge.input_tokens = 2**70  # SQLite cannot hold it: OverflowError, not a sqlite3.Error
    good = [row(i) for i in range(2, 40)]
    # queued before the writer starts, so all of them share one group commit
    futures = [ledger.submit(r) for r in [*good[:10], huge, row(0), *good[10:]]]
    ledger.start()
    results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
    assert isinstance(results[10], OverflowError)
    assert isinstance(results[11], sqlite3.IntegrityError)  # the duplicate request id
    assert [r for i, r in enumerate(results) if i not in (10, 11)] == [None] * len(good)
    await ledger.record(row(99))  # the writer is still alive
    assert ledger.ready
    stored = {r.request_id for r in ledger.rows()}
    assert stored == {"r0", "r99"} | {r.request_id for r in good}
    assert ledger.get("r0").input_tokens == 10  # the duplicate did not overwrite the first row
    ledger.close()


async def test_a_locked_database_times_out_record_and_makes_the_ledger_not_ready(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    ledger = Ledger(db, busy_timeout_s=0.05)
    assert not ledger.ready and ledger.not_ready_reason == "the ledger writer is not running"
    ledger.start()
    await ledger.record(row(0))
    assert ledger.ready and ledger.not_ready_reason is None
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock past the writer's busy timeout
    with pytest.raises(LedgerUnavailable, match="database is locked"):
        await ledger.record(row(1), timeout_s=0.5)
    assert not ledger.ready and "database is locked" in ledger.not_ready_reason  # type: ignore[operator]
    late = ledger.submit(row(2))  # the gateway's way: queue first, wait after releasing what it held
    with pytest.raises(LedgerUnavailable):
        await ledger.wait_durable(late, timeout_s=0.2)
    assert not late.done()  # kept, not failed: the writer retries
    blocker.execute("ROLLBACK")
    await ledger.wait_durable(late)
    assert ledger.ready
    # the row whose `record` timed out was not dropped either
    assert sorted(r.request_id for r in ledger.rows()) == ["r0", "r1", "r2"]
    blocker.close()
    ledger.close()


async def test_a_full_disk_makes_the_ledger_not_ready_until_space_returns(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    max_pages: list[int] = []

    def cap_the_disk(conn: sqlite3.Connection) -> None:  # runs on each (re)connection of the writer
        if max_pages:
            conn.execute(f"PRAGMA max_page_count = {max_pages[0]}")

    ledger = Ledger(db, record_timeout_s=1.0, busy_timeout_s=0.05, on_connect=cap_the_disk)
    ledger.record_now([row(0)])
    max_pages.append(sqlite3.connect(db).execute("PRAGMA page_count").fetchone()[0])
    pending = [ledger.submit(row(i)) for i in range(2, 300)]  # one group, more than the pages left can hold
    ledger.start()
    with pytest.raises(LedgerUnavailable, match="full"):  # record's default timeout is the ledger's
        await ledger.record(row(1))
    assert not ledger.ready and "SQLITE_FULL" in ledger.not_ready_reason  # type: ignore[operator]
    await asyncio.sleep(0.2)
    assert not any(f.done() for f in pending)
    max_pages.clear()  # space again
    await asyncio.wait_for(asyncio.gather(*pending), 10)
    assert ledger.ready
    assert {r.request_id for r in ledger.rows()} == {f"r{i}" for i in range(300)}
    ledger.close()


async def test_closing_a_ledger_that_cannot_commit_gives_up_after_the_record_timeout(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    ledger = Ledger(db, record_timeout_s=0.3, busy_timeout_s=0.05)
    ledger.start()
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    waiting = ledger.submit(row(1))
    ledger.close()  # returns, rather than waiting on the lock forever
    with pytest.raises(LedgerUnavailable, match="database is locked"):
        await asyncio.wait_for(waiting, 5)
    blocker.close()


async def test_an_unexpected_error_in_the_writer_is_retried_not_fatal(tmp_path: Path) -> None:
    failures = [RuntimeError("a bug"), MemoryError()]

    def flaky(conn: sqlite3.Connection) -> None:
        if failures:
            raise failures.pop(0)

    ledger = Ledger(tmp_path / "ledger.db", on_connect=flaky)
    ledger.start()
    await ledger.record(row(1))  # written once the writer got past both errors
    assert ledger.ready and not failures and [r.request_id for r in ledger.rows()] == ["r1"]
    ledger.close()


async def test_a_cancelled_caller_still_has_its_row_written(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    ledger = Ledger(db, busy_timeout_s=0.05)
    ledger.start()
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    caller = asyncio.create_task(ledger.record(row(1)))
    await asyncio.sleep(0.1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    blocker.execute("ROLLBACK")
    await ledger.record(row(2))
    assert sorted(r.request_id for r in ledger.rows()) == ["r1", "r2"]
    blocker.close()
    ledger.close()
