"""Idempotency-Key work on SQLite while another connection holds the database's write lock (the CLI, another process's
long transaction): one tenant's renewal, claim or stored answer waiting on the lock (up to its busy timeout, 5 s) must
not hold up another tenant's replay, which needs no lock (the records are read under WAL), and a renewal must not wait
behind a claim waiting on the lock. All of it ran on the store's one thread, one call after another: a replay waited
out the call ahead of it, and a renewal queued behind claims could end past its lease. The lock is real: a second
connection's `BEGIN IMMEDIATE`."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from quotas.idempotency import Claim, Replay
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import LedgerUnavailable

T = TypeVar("T")
STUCK_S = 0.2  # a call seen still waiting this long is waiting on the lock
PROMPT_S = 1.0  # another tenant's replay is answered within this (the claims' busy timeout is 5 s)
ANSWER = {"id": "chatcmpl-g1", "text": "paid"}


@contextmanager
def write_locked(path: Path) -> Iterator[None]:
    """The database's write lock held by another connection meanwhile."""
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        writer.execute("ROLLBACK")
        writer.close()


async def stuck(work: Awaitable[Any]) -> asyncio.Future[Any]:
    """`work` started, and seen still waiting (on the lock) after STUCK_S."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=STUCK_S)
    assert not done, f"the call was meant to wait on the lock: {task.exception()}"
    return task


async def prompt(work: Awaitable[T], within_s: float = PROMPT_S) -> T:
    try:
        return await asyncio.wait_for(work, within_s)
    except TimeoutError:
        raise AssertionError(f"held up over {within_s:g} s by another tenant's call waiting on the lock") from None


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteIdempotency]:
    s = SQLiteIdempotency(tmp_path / "ledger.db")
    yield s
    await s.close()


@pytest.mark.parametrize("what", ["renew", "claim", "finish_alone"])
async def test_a_call_waiting_on_the_lock_holds_up_no_other_tenants_replay(
        store: SQLiteIdempotency, tmp_path: Path, what: str) -> None:
    globex = await store.begin("globex", "paid", "body", "g1", lease_s=60)
    assert isinstance(globex, Claim)
    await store.finish_alone(globex, ANSWER, 3600)
    acme = await store.begin("acme", "k", "body", "a1", lease_s=60)
    assert isinstance(acme, Claim)
    work: dict[str, Callable[[], Awaitable[Any]]] = {
        "renew": lambda: store.renew(acme, 60),
        "claim": lambda: store.begin("acme", "new", "body", "a2", lease_s=60),
        "finish_alone": lambda: store.finish_alone(acme, {"text": "late"}, 3600)}
    with write_locked(tmp_path / "ledger.db"):
        waiting = await stuck(work[what]())
        assert await prompt(store.begin("globex", "paid", "body", "g2", lease_s=60)) == Replay(ANSWER)
        assert await prompt(store.stored("globex", "paid", "body")) == Replay(ANSWER)
    await asyncio.gather(waiting, return_exceptions=True)  # the lock released: it goes on (or failed, for a renewal)


async def test_a_renewal_does_not_wait_behind_a_claim_waiting_on_the_lock(store: SQLiteIdempotency,
                                                                         tmp_path: Path) -> None:
    """The renewal tries the lock itself, briefly, and fails while it is held (to be tried again soon,
    gateway/pipeline/idempotency.py), not 5 s after the claim ahead of it gave up; renewed once the lock is free."""
    acme = await store.begin("acme", "k", "body", "a1", lease_s=60)
    assert isinstance(acme, Claim)
    with write_locked(tmp_path / "ledger.db"):
        claiming = await stuck(store.begin("globex", "new", "body", "g1", lease_s=60))
        with pytest.raises(LedgerUnavailable, match="locked"):
            await prompt(store.renew(acme, 60), within_s=2.0)  # its own wait for the lock is shorter
    assert await store.renew(acme, 60)
    assert isinstance(await claiming, Claim)  # the claim went on once the lock was released


async def test_claims_queued_in_a_lock_out_each_fail_within_their_own_busy_timeout(tmp_path: Path) -> None:
    """A lock-out longer than the busy timeout: claims queue on the writes' thread, and each waited the whole timeout
    from its turn, so the tenth was refused after ten timeouts (50 s at the gateway's 5 s). Each is refused
    (LedgerUnavailable: the stage's 503 `idempotency_unavailable`) by its own deadline, and claims nothing."""
    busy_s, claims = 0.2, 10
    store = SQLiteIdempotency(tmp_path / "ledger.db", busy_s=busy_s)
    try:
        with write_locked(tmp_path / "ledger.db"):
            try:  # one after another, the last is refused after claims * busy_s
                refused = await asyncio.wait_for(asyncio.gather(
                    *(store.begin("acme", f"k{i}", "body", f"a{i}", lease_s=60) for i in range(claims)),
                    return_exceptions=True), claims * busy_s / 2)
            except TimeoutError:
                raise AssertionError("the claims were refused one busy timeout after another") from None
        assert all(isinstance(r, LedgerUnavailable) for r in refused), refused
        for i in range(claims):  # nothing was claimed: the keys are free for another request
            again = await store.begin("acme", f"k{i}", "body", f"b{i}", lease_s=60)
            assert isinstance(again, Claim) and again.owner == f"b{i}"
    finally:
        await store.close()
