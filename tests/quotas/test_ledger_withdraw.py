"""`wait_durable(withdraw=True)` in every interleaving of a row with the writer (quotas/ledger.py): still queued, the
row is withdrawn at once and never written; in flight, its commit decides (committed: durable; not committed:
withdrawn then, never written afterwards); in doubt after a commit whose reply was lost (PostgreSQL's `_landed`), the
writer's answer decides. A waiter without `withdraw` (the quota's settlement) waits for a pending withdrawal's end."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from quotas.ledger import Ledger, LedgerUnavailable, RowWithdrawn
from quotas.ledger_postgres import PostgresLedger
from quotas.ledger_withdrawals import withdrawn
from tests.pg_proxy import PgProxy
from tests.quotas.test_ledger import row

WAIT_S = 0.2


class Gate:
    """The ledger's next commit held until `open`; then `then(real)` decides it (by default: commit)."""

    def __init__(self, ledger: Ledger, then: Callable[..., list[Exception | None]] | None = None) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        self.armed = True
        real = ledger._commit

        def commit(conn: Any, rows: list[Any], counts: Any, **kwargs: Any) -> list[Exception | None]:
            if self.armed and rows:
                self.armed = False
                self.entered.set()
                assert self.opened.wait(10)
                if then is not None:
                    return then(real, conn, rows, counts, **kwargs)
            return real(conn, rows, counts, **kwargs)

        ledger._commit = commit  # type: ignore[method-assign]

    async def held(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 5)


def fail_once(real: Any, conn: Any, rows: Any, counts: Any, **kwargs: Any) -> list[Exception | None]:
    raise sqlite3.OperationalError("disk I/O error")  # the database's fault: nothing committed, the rows kept


def commit_then_lose_reply(real: Any, conn: Any, rows: Any, counts: Any, **kwargs: Any) -> list[Exception | None]:
    real(conn, rows, counts, **kwargs)
    raise sqlite3.OperationalError("disk I/O error")  # as a COMMIT whose reply was lost on the way back


def ids(ledger: Ledger) -> list[str]:
    return sorted(r.request_id for r in ledger.rows())


@pytest.fixture
async def ledger(tmp_path: Path):  # type: ignore[no-untyped-def]
    ledger = Ledger(tmp_path / "ledger.db", record_timeout_s=WAIT_S)
    ledger.start()
    yield ledger
    ledger.close()


async def test_a_row_still_queued_is_withdrawn_at_once_and_never_written(ledger: Ledger) -> None:
    gate = Gate(ledger)
    first = ledger.submit(row(0))  # its commit held: the writer is busy
    await gate.held()
    late, kept = ledger.submit(row(1)), ledger.submit(row(2))  # queued behind it
    with pytest.raises(RowWithdrawn):
        await ledger.wait_durable(late, withdraw=True)
    assert withdrawn(late) and not kept.done()
    with pytest.raises(LedgerUnavailable):  # without `withdraw`: the row stays queued, as before
        await ledger.wait_durable(kept)
    gate.opened.set()
    await ledger.wait_durable(first)
    await ledger.wait_durable(kept)
    await ledger.record(row(3))  # the writer has taken everything queued before it
    assert ids(ledger) == ["r0", "r2", "r3"]


async def test_a_row_in_flight_is_its_commits_and_durable_if_it_commits(ledger: Ledger) -> None:
    gate = Gate(ledger)
    written = ledger.submit(row(0))
    await gate.held()
    waiting = asyncio.ensure_future(ledger.wait_durable(written, withdraw=True))
    await asyncio.sleep(WAIT_S * 2)  # past its wait: its withdrawal is pending, it waits on
    assert not waiting.done()
    follower = asyncio.ensure_future(ledger.wait_durable(written, timeout_s=0.01))  # the quota's: waits too
    await asyncio.sleep(0.05)
    assert not follower.done()
    gate.opened.set()
    await waiting  # durable: the client gets the answer it is billed for
    await follower
    assert not withdrawn(written) and ids(ledger) == ["r0"]


async def test_a_row_in_flight_whose_commit_fails_is_withdrawn_then_and_never_written(ledger: Ledger) -> None:
    gate = Gate(ledger, then=fail_once)
    written, other = ledger.submit(row(0)), ledger.submit(row(1))  # one group
    await gate.held()
    waiting = asyncio.ensure_future(ledger.wait_durable(written, withdraw=True))
    await asyncio.sleep(WAIT_S * 2)
    assert not waiting.done()
    gate.opened.set()
    with pytest.raises(RowWithdrawn):
        await waiting
    await ledger.wait_durable(other, timeout_s=10)  # its group-mate, not withdrawn, is written by the retry
    assert ids(ledger) == ["r1"]


@pytest.mark.parametrize("landed", [True, False])
async def test_a_row_in_doubt_is_decided_by_what_the_database_says_it_wrote(ledger: Ledger, landed: bool) -> None:
    ledger.COMMIT_IN_DOUBT_AFTER_FAILURE = True  # as PostgreSQL's: a commit that raised may have landed
    asked = threading.Event()
    told = threading.Event()

    def landed_rows(conn: Any, rows: list[Any]) -> list[bool] | None:
        asked.set()
        if not told.is_set():
            raise sqlite3.OperationalError("the database cannot tell yet")  # asked again, the rows kept in doubt
        return [True] * len(rows) if landed else None

    ledger._landed = landed_rows  # type: ignore[method-assign]
    gate = Gate(ledger, then=commit_then_lose_reply if landed else fail_once)
    written = ledger.submit(row(0))
    await gate.held()
    waiting = asyncio.ensure_future(ledger.wait_durable(written, withdraw=True))
    await asyncio.sleep(WAIT_S * 2)
    gate.opened.set()
    assert await asyncio.to_thread(asked.wait, 5)
    await asyncio.sleep(WAIT_S)
    assert not waiting.done()  # in doubt: neither answer can be given yet
    told.set()
    if landed:
        await waiting  # it committed: durable, answered
        assert ids(ledger) == ["r0"]
    else:
        with pytest.raises(RowWithdrawn):
            await waiting
        await ledger.record(row(1))
        assert ids(ledger) == ["r1"]


async def test_a_ledger_whose_only_rows_were_withdrawn_is_ready_again_once_it_can_commit(tmp_path: Path) -> None:
    """Nothing left to write after a fault (its rows withdrawn), the writer still finds out when the database can
    commit again: else the ledger stayed not ready, and the gateway refused the work that would have written a row."""
    db = tmp_path / "ledger.db"
    ledger = Ledger(db, record_timeout_s=WAIT_S, busy_timeout_s=0.05)
    ledger.start()
    await ledger.record(row(0))
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock past the writer's busy timeout
    with pytest.raises(RowWithdrawn):
        await ledger.wait_durable(ledger.submit(row(1)), withdraw=True)
    assert not ledger.ready
    blocker.execute("ROLLBACK")
    for _ in range(100):
        if ledger.ready:
            break
        await asyncio.sleep(0.05)
    assert ledger.ready, ledger.not_ready_reason
    assert ids(ledger) == ["r0"]
    blocker.close()
    ledger.close()


async def test_postgres_a_row_whose_commit_landed_as_its_reply_was_lost_is_durable_not_withdrawn(
        pg_proxy: PgProxy, database_url: str) -> None:
    """The row's commit under way past its wait, and its reply lost: the request waits for the writer to ask the
    server, which says it committed; the row is durable (the client gets its answer), not withdrawn."""
    ledger = PostgresLedger(pg_proxy.url(database_url), record_timeout_s=WAIT_S)
    gate = Gate(ledger)
    ledger.start()
    try:
        written = ledger.submit(row(0))
        await gate.held()
        pg_proxy.lose = b"COMMIT"
        waiting = asyncio.ensure_future(ledger.wait_durable(written, withdraw=True))
        await asyncio.sleep(WAIT_S * 2)
        assert not waiting.done()
        gate.opened.set()
        await asyncio.wait_for(waiting, 10)
        assert pg_proxy.lost == 1 and not withdrawn(written)
        assert ids(ledger) == ["r0"]
    finally:
        ledger.close()


async def test_postgres_a_row_withdrawn_while_the_table_is_locked_is_never_written(database_url: str) -> None:
    ledger = PostgresLedger(database_url, record_timeout_s=WAIT_S, busy_timeout_s=0.1)
    ledger.start()
    try:
        await ledger.record(row(0))
        blocker = psycopg.connect(database_url)  # another session holds the table past the statement timeout
        blocker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(RowWithdrawn):
            await ledger.wait_durable(ledger.submit(row(1)), withdraw=True)
        # not asserted: `not ledger.ready` here. The writer, left with no rows, probes with an empty commit, which the
        # table's lock does not hold up, so it may be ready again already (the full run lost that race once)
        blocker.rollback()
        blocker.close()
        for _ in range(100):  # ready again with nothing of its own to write (an empty commit told it)
            if ledger.ready:
                break
            await asyncio.sleep(0.05)
        assert ledger.ready, ledger.not_ready_reason
        assert ids(ledger) == ["r0"]
    finally:
        ledger.close()
