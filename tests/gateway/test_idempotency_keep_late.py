"""gateway/pipeline/idempotency.py's `keep_when_written` on a real redis-server: a row still pending past its wait
(`for_s`, short here, 120 s in the gateway) is handed to the store, which keeps the answer once the row commits, even
after the claim's lease: the retry replays it instead of running and being billed again (as the SQL stores keep it)."""

from __future__ import annotations

import asyncio

from gateway.pipeline.idempotency import Keep, keep_when_written
from quotas import idempotency
from quotas.idempotency import Claim, Replay
from quotas.idempotency_redis import RedisIdempotency

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
