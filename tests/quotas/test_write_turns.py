"""Processes that share a SQLite ledger (`--workers N`) take turns at committing (quotas/write_turns.py): a commit
waits in the kernel for the turn, not in SQLite's sleeping busy handler, and goes as soon as the turn is free."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from quotas.ledger import Ledger
from quotas.write_turns import WriteTurns
from tests.quotas.test_ledger import row


def test_one_turn_at_a_time_across_holders_of_the_same_file(tmp_path: Path) -> None:
    first, second = WriteTurns(tmp_path / "ledger.db"), WriteTurns(tmp_path / "ledger.db")
    entered = threading.Event()

    def take_second() -> None:
        with second.turn():
            entered.set()

    with first.turn():
        waiter = threading.Thread(target=take_second)
        waiter.start()
        assert not entered.wait(0.3)  # the other holder waits while the turn is taken
    assert entered.wait(5)  # and gets it once it is given back
    waiter.join(5)
    first.close()
    second.close()


def test_a_ledger_commit_waits_for_the_turn_then_goes_at_once(tmp_path: Path) -> None:
    """Another process holding the turn (here another holder of the lock file) keeps the ledger's commit back;
    the row is durable as soon as the turn is free. Before the turns, SQLite alone decided, and the commit went
    through while the other held only the turn."""
    path = tmp_path / "ledger.db"
    other = WriteTurns(path)

    async def main() -> None:
        ledger = Ledger(path)
        ledger.start()
        try:
            await ledger.record(row(0))  # the writer's connection is open: the next commit only waits for its turn
            with other.turn():
                pending = asyncio.ensure_future(ledger.record(row(1)))
                done, _ = await asyncio.wait({pending}, timeout=0.3)
                assert not done  # held back while the other process writes
            await asyncio.wait_for(pending, timeout=5)
            assert ledger.get("r1") is not None
        finally:
            ledger.close()
            other.close()

    asyncio.run(main())


def test_a_turn_held_forever_is_waited_for_a_bounded_time_then_gone_without(tmp_path: Path) -> None:
    """A holder stopped by SIGSTOP or a debugger keeps its turn: the ledger commits without one after the busy
    timeout (SQLite's own lock then decides, as without turns), instead of waiting in the kernel for ever while
    it says it is ready (found in review)."""
    path = tmp_path / "ledger.db"
    stuck = WriteTurns(path)

    async def main() -> None:
        ledger = Ledger(path, busy_timeout_s=0.3)
        ledger.start()
        try:
            with stuck.turn():  # never given back while the row is written
                await asyncio.wait_for(ledger.record(row(0)), timeout=5)
            assert ledger.get("r0") is not None and ledger.ready
        finally:
            ledger.close()
            stuck.close()

    asyncio.run(main())


def test_a_lock_file_that_cannot_be_locked_turns_the_turns_off(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without flock (ENOLCK), or a lock file another user made: the ledger writes as it did without
    turns, rather than fail every commit (found in review)."""
    from quotas import write_turns

    def no_locks(fd: int, op: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(write_turns.fcntl, "flock", no_locks)

    async def main() -> None:
        ledger = Ledger(tmp_path / "ledger.db")
        ledger.start()
        try:
            await asyncio.wait_for(ledger.record(row(1)), timeout=5)
            await asyncio.wait_for(ledger.record(row(2)), timeout=5)
            assert ledger.ready and ledger.get("r2") is not None
        finally:
            ledger.close()

    asyncio.run(main())
