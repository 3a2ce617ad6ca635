"""A request whose Idempotency-Key lease could not be renewed before it may end is stopped (gateway/pipeline/
idempotency.py's `Keep`), before a retry with its key can take the key over: it went on, answered and was billed while
the retry ran and was billed too, two runs for one key. Its client is told 503 `idempotency_lease_lost`. The stores
here: a fake that keeps a record's lease on the monotonic clock, whose renewals fail or say the record is no longer the
claim's, and the real SQLite store, its renewals failing because another connection holds the write lock. Through a
gateway: tests/gateway/test_idempotency_lease_lost_api.py."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from gateway.errors import Unavailable
from gateway.pipeline.idempotency import IdempotencyStage, Keep, lease_lost
from quotas.idempotency import Begun, Claim, IdempotencyStore, Running
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import LedgerUnavailable
from tests.gateway.test_idempotency_claim_cancel import Body, ctx

LEASE_S = 0.6
RACE_LEASE_S = 1.5  # the stage stops a request a thirtieth of its lease before the lease can end: 50 ms here


class LeaseOnlyStore(IdempotencyStore):
    """One record per key, its lease on the monotonic clock; `renew` raises (the store unreachable) or, with
    `taken_over`, says False (the record is another request's)."""

    def __init__(self, *, taken_over: bool = False) -> None:
        self.records: dict[str, tuple[str, float]] = {}  # key -> owner, lease's end
        self.taken_over = taken_over
        self.renewals = 0

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        held = self.records.get(key)
        if held is not None and held[1] > time.monotonic():
            return Running()
        self.records[key] = (owner, time.monotonic() + lease_s)
        return Claim(tenant, key, fingerprint, owner)

    async def abandon(self, claim: Claim) -> None:
        if self.records.get(claim.key, ("",))[0] == claim.owner:
            del self.records[claim.key]

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        self.renewals += 1
        if self.taken_over:
            return False
        raise LedgerUnavailable("the store cannot be reached")


async def running(stage: IdempotencyStage, claim: Claim, log: list[str]) -> None:
    """A request holding `claim` while it runs (as handle.py and the embeddings route do): stopped for its lease, its
    client is told `lease_lost()`."""
    keep = Keep(claim, stage.renewing(claim))
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        if keep.stopped():
            log.append("r1 stopped")
            raise lease_lost() from None
        raise
    finally:
        keep.settle()


async def retrying(store: IdempotencyStore, log: list[str]) -> None:
    """A retry with the key, asking for it until it can claim it."""
    while not isinstance(await store.begin("acme", "key-1", "fp", "r2", lease_s=RACE_LEASE_S), Claim):
        await asyncio.sleep(0.005)
    log.append("r2 claimed")


@pytest.mark.parametrize("taken_over", [False, True], ids=["renewals-fail", "record-not-the-claims"])
async def test_a_request_whose_lease_may_end_is_stopped_before_a_retry_can_claim_its_key(taken_over: bool) -> None:
    store = LeaseOnlyStore(taken_over=taken_over)
    stage = IdempotencyStage(store, lease_s=RACE_LEASE_S)
    claim = await stage.begin(ctx("r1"), Body(text="hi"), route="test")
    assert isinstance(claim, Claim)
    log: list[str] = []
    request = asyncio.create_task(running(stage, claim, log))
    retry = asyncio.create_task(retrying(store, log))
    await asyncio.wait({retry}, timeout=2 * RACE_LEASE_S)
    assert log[:1] == ["r1 stopped"], f"the retry claimed the key while its first request still ran: {log}"
    with pytest.raises(Unavailable) as raised:
        await request
    assert raised.value.status_code == 503 and raised.value.body()["error"]["code"] == "idempotency_lease_lost"
    assert raised.value.body()["error"]["param"] == "Idempotency-Key"
    assert store.renewals >= 1
    retry.cancel()
    await asyncio.gather(retry, return_exceptions=True)


async def test_a_request_suspended_when_its_lease_is_lost_is_stopped_as_it_resumes() -> None:
    """Its task is its consumer's meanwhile (a stream's sender): never cancelled for this."""
    stage = IdempotencyStage(LeaseOnlyStore(), lease_s=LEASE_S)
    claim = await stage.begin(ctx("r1"), Body(text="hi"), route="test")
    assert isinstance(claim, Claim)
    keep = Keep(claim, stage.renewing(claim))
    keep.suspend()
    assert keep.renewal is not None
    await keep.renewal  # the lease is lost; this task, suspended for the request, is not cancelled
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="could not be renewed"):
        keep.resume()
    keep.settle()


async def test_a_request_suspended_when_its_lease_is_lost_has_its_work_stopped_then() -> None:
    """Its `stop` (handle.py: its answer closed, its slots and claim freed) runs as the lease is lost, not when its
    consumer resumes it (a client not reading may not for a minute); its client is told as it resumes."""
    stage = IdempotencyStage(LeaseOnlyStore(), lease_s=LEASE_S)
    claim = await stage.begin(ctx("r1"), Body(text="hi"), route="test")
    assert isinstance(claim, Claim)
    keep = Keep(claim, stage.renewing(claim))
    stopped = asyncio.Event()

    async def stop() -> None:
        stopped.set()

    keep.suspend(stop)
    await asyncio.wait_for(stopped.wait(), 10 * LEASE_S)  # never resumed meanwhile
    await keep.halted()
    with pytest.raises(Unavailable, match="could not be renewed"):
        keep.resume()
    keep.settle()


async def test_an_answered_request_is_not_stopped_for_its_lease() -> None:
    """Its answer is the claim's: the client gets it (what a retry replays)."""
    stage = IdempotencyStage(LeaseOnlyStore(taken_over=True), lease_s=LEASE_S)
    claim = await stage.begin(ctx("r1"), Body(text="hi"), route="test")
    assert isinstance(claim, Claim)
    keep = Keep(claim, stage.renewing(claim))
    keep.stored = True
    assert keep.renewal is not None
    await keep.renewal
    await asyncio.sleep(0)
    keep.resume()  # no error
    keep.settle()


async def test_a_request_is_stopped_while_sqlite_is_locked_past_its_lease(tmp_path: Path) -> None:
    """The real SQLite store: another connection holds the write lock (`BEGIN IMMEDIATE`), so every renewal fails for
    real (no claim can be taken meanwhile either); the request is stopped by the time its lease has ended."""
    path = tmp_path / "ledger.db"
    store = SQLiteIdempotency(path, busy_s=0.1)
    stage = IdempotencyStage(store, lease_s=LEASE_S)
    try:
        claim = await stage.begin(ctx("r1"), Body(text="hi"), route="test")
        assert isinstance(claim, Claim)
        writer = sqlite3.connect(path, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")
        try:
            log: list[str] = []
            request = asyncio.create_task(running(stage, claim, log))
            (expires,) = writer.execute("SELECT expires FROM idempotency WHERE key = 'key-1'").fetchone()
            await asyncio.wait({request}, timeout=expires - time.time() + LEASE_S)  # the lease's end, and some
            assert log == ["r1 stopped"], "the lease ended and its request still ran"
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        with pytest.raises(Unavailable, match="could not be renewed"):
            await request
    finally:
        await store.close()
