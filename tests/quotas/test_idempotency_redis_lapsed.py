"""RedisIdempotency stores an answer only after its ledger row is durable (gateway/pipeline/idempotency_keep.py): a
gateway killed in between (or while Redis refused the write, owed in its memory) left the key's `running` claim to
lapse with its lease, and a retry with the key ran and was billed a second time. The claim's record is kept past its
lease (`CLAIM_KEPT_S`); a retry that finds its lease over looks for its owner's row in the gateway's ledger (`rows`):
billed, the retry is told so (the 409 of an answer not kept, `lost()`), never run; no row, or one of a request that
failed (its claim would have been given up), the key is taken over, as before."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quotas.idempotency import NOT_KEPT, Claim, Mismatch, Replay, Running, not_kept
from quotas.idempotency_redis import RedisIdempotency
from quotas.ledger import Ledger, LedgerUnavailable
from tests.quotas.test_ledger import row

LEASE_S = 0.3


@pytest.fixture
async def store(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[RedisIdempotency, Ledger]]:
    """A replica's store on Redis, beside the gateway's SQLite ledger."""
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.start()
    store = RedisIdempotency(redis_url)
    store.rows = ledger
    yield store, ledger
    await store.close()
    ledger.close()


async def died_after(store: RedisIdempotency, ledger: Ledger, status: str | None) -> Claim:
    """Request r1 claims k1; its row commits with `status` (None: no row), then its gateway dies before the answer is
    stored, and its lease ends."""
    claim = await store.begin("acme", "k1", "body", "r1", lease_s=LEASE_S)
    assert isinstance(claim, Claim)
    if status is not None:
        ledger.record_now([dataclasses.replace(row(1), status=status)])
    await asyncio.sleep(LEASE_S + 0.1)
    return claim


async def test_a_retry_after_a_billed_request_whose_answer_was_lost_is_told_so_not_run(
        store: tuple[RedisIdempotency, Ledger]) -> None:
    redis, ledger = store
    await died_after(redis, ledger, "ok")
    for retry in ("r2", "r3"):  # the record stays: every retry is told, none runs
        begun = await redis.begin("acme", "k1", "body", retry, lease_s=LEASE_S)
        assert isinstance(begun, Replay) and not_kept(begun.answer) == 0, begun
    assert await redis.begin("acme", "k1", "another body", "r4", lease_s=LEASE_S) == Mismatch()


@pytest.mark.parametrize("status", [None, "error", "cancelled"])
async def test_a_claim_whose_owner_died_unbilled_or_failed_is_taken_over(store: tuple[RedisIdempotency, Ledger],
                                                                        status: str | None) -> None:
    """No row (it died running), or the row of a request that failed or whose client left (its claim is given up as
    it ends, so a retry runs): the lapsed claim is taken over, by a retry with any body, and held by it."""
    redis, ledger = store
    old = await died_after(redis, ledger, status)
    assert await redis.begin("acme", "k1", "another body", "r2", lease_s=60) == Claim("acme", "k1", "another body",
                                                                                        "r2")
    assert await redis.begin("acme", "k1", "another body", "r3", lease_s=60) == Running()
    assert not await redis.renew(old, 60)  # the dead owner's claim is not its own any more


async def test_a_live_claim_is_not_looked_up_and_a_renewed_one_does_not_lapse(
        store: tuple[RedisIdempotency, Ledger]) -> None:
    redis, ledger = store
    claim = await redis.begin("acme", "k1", "body", "r1", lease_s=LEASE_S)
    assert isinstance(claim, Claim)
    ledger.record_now([row(1)])
    for _ in range(3):
        await asyncio.sleep(LEASE_S / 2)
        assert await redis.renew(claim, LEASE_S)
        assert await redis.begin("acme", "k1", "body", "r2", lease_s=LEASE_S) == Running()
    await redis.finish(claim, {"text": "the answer"}, 60)
    assert await redis.begin("acme", "k1", "body", "r2", lease_s=LEASE_S) == Replay({"text": "the answer"})


async def test_without_the_ledger_a_lapsed_claim_is_taken_over(redis_url: str) -> None:
    """A store not told the gateway's ledger (tools, tests) takes a lapsed claim over, as before."""
    redis = RedisIdempotency(redis_url)
    try:
        assert isinstance(await redis.begin("acme", "k1", "body", "r1", lease_s=LEASE_S), Claim)
        await asyncio.sleep(LEASE_S + 0.1)
        assert isinstance(await redis.begin("acme", "k1", "body", "r2", lease_s=LEASE_S), Claim)
    finally:
        await redis.close()


async def test_a_ledger_that_cannot_be_read_claims_nothing(store: tuple[RedisIdempotency, Ledger],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger failing to say whether the lapsed claim was billed: a 503 (nothing claimed or run), then, once it
    answers, what it says."""
    redis, ledger = store
    await died_after(redis, ledger, "ok")

    def failing(request_id: str) -> None:
        raise OSError("disk I/O error")

    monkeypatch.setattr(ledger, "get", failing)
    with pytest.raises(LedgerUnavailable):
        await redis.begin("acme", "k1", "body", "r2", lease_s=LEASE_S)
    monkeypatch.undo()
    begun = await redis.begin("acme", "k1", "body", "r2", lease_s=LEASE_S)
    assert isinstance(begun, Replay) and NOT_KEPT in begun.answer
