"""gateway/pipeline/idempotency.py's `keep_when_written` on a real redis-server: a row still pending past its wait
(`for_s`, short here, 120 s in the gateway) is handed to the store, which keeps the answer once the row commits, even
after the claim's lease: the retry replays it instead of running and being billed again (as the SQL stores keep it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.pipeline.idempotency import Keep, keep_when_written
from quotas import idempotency
from quotas.idempotency import Claim, IdempotencyStore, Replay, Running
from quotas.idempotency_redis import RedisIdempotency
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger_withdrawals import RowWithdrawn

LEASE_S = 0.3
ANSWER = {"id": "chatcmpl-1", "text": "hello"}


async def test_a_row_committed_after_the_wait_keeps_its_answer_on_redis(redis_url: str) -> None:
    store = RedisIdempotency(redis_url)
    try:
        claim = await store.begin("acme", "order-1", "fp", "req-1", lease_s=LEASE_S)
        assert isinstance(claim, Claim)
        row: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await keep_when_written(store, row, Keep(claim), ANSWER, 60, for_s=0.05)  # the wait ends, the row still pending
        await asyncio.sleep(LEASE_S + 0.1)
        row.set_result(None)  # committed, billed, after the wait and the lease
        await asyncio.sleep(0)
        await asyncio.gather(*idempotency._FOLLOWING)
        again = await store.begin("acme", "order-1", "fp", "req-2", lease_s=LEASE_S)
        assert again == Replay(ANSWER), "the retry ran again: billed twice for one key"
    finally:
        await store.close()



FIRST = {"id": "chatcmpl-0", "text": "the first answer, which stands"}


@pytest.fixture(params=["sqlite", "redis"])
async def records(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[IdempotencyStore]:
    store: IdempotencyStore = SQLiteIdempotency(tmp_path / "ledger.sqlite3") if request.param == "sqlite" else \
        RedisIdempotency(request.getfixturevalue("redis_url"))
    yield store
    await store.close()


async def handed_to_the_store(store: IdempotencyStore, key: str) -> tuple[Claim, Keep, asyncio.Future[None]]:
    """A claim whose answer went with a ledger row still in doubt past the follower's wait (120 s in the gateway)."""
    claim = await store.begin("acme", key, "fp", "req-1", lease_s=60)
    assert isinstance(claim, Claim)
    row: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    keep = Keep(claim)
    keep.kept_with(row)
    await keep_when_written(store, row, keep, ANSWER, 60, for_s=0.05)
    return claim, keep, row


async def test_a_row_withdrawn_after_the_wait_leaves_the_claim_to_its_running_request(
        records: IdempotencyStore) -> None:
    """A retry's row in doubt past the follower's wait, then withdrawn while its request still runs: the claim is the
    request's again (a cascade's first answer stands and is stored under the key), as it is for a row withdrawn within
    the wait; the store's follower gave it up, and a retry with the key ran, and was billed, again."""
    claim, keep, row = await handed_to_the_store(records, "order-2")
    row.set_exception(RowWithdrawn("withdrawn"))  # its commit did not land
    await asyncio.sleep(0)  # the store's follower sees it first, and ends its work
    await asyncio.gather(*idempotency._FOLLOWING)
    assert isinstance(await records.begin("acme", "order-2", "fp", "req-2", lease_s=60), Running)  # still claimed
    keep.row_withdrawn(row)  # then the request, still running (its error on the way up through awaits)
    assert not keep.stored
    keep.stored = True  # a cascade's first answer takes the claim (gateway/pipeline/cascade.py)
    await records.finish_alone(claim, FIRST, 60)
    again = await records.begin("acme", "order-2", "fp", "req-3", lease_s=60)
    assert again == Replay(FIRST), "the retry ran again: billed twice for one key"


async def test_a_row_withdrawn_after_the_wait_and_its_request_gives_the_claim_up(records: IdempotencyStore) -> None:
    _, keep, row = await handed_to_the_store(records, "order-3")
    keep.settle()  # the request is over (its client left), the claim still the row's
    row.set_exception(RowWithdrawn("withdrawn"))
    await asyncio.sleep(0)
    await asyncio.gather(*idempotency._FOLLOWING)
    again = await records.begin("acme", "order-3", "fp", "req-2", lease_s=60)
    assert isinstance(again, Claim), again  # given up: the retry runs, not held for the lease
