"""An Idempotency-Key's answer on Redis whose ledger row commits late, past the gateway's wait for it and even past
its claim's lease, is kept as the SQL stores keep it (there it commits with the row); a row refused for good gives the
claim up; nothing extends the claim's TTL, and what is held meanwhile is bounded. A real redis-server; the row is the
ledger's future, settled by hand; the claim's lease is short (0.3 s) instead of the gateway's 10 minutes."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quotas import idempotency, idempotency_redis
from quotas.idempotency import Claim, Replay, Running
from quotas.idempotency_redis import RedisIdempotency
from quotas.idempotency_sqlite import SQLiteIdempotency

LEASE_S = 0.3
ANSWER = {"id": "chatcmpl-1", "text": "hello"}


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisIdempotency]:
    s = RedisIdempotency(redis_url)
    yield s
    await s.close()


async def claimed(store: RedisIdempotency, key: str, owner: str = "req-1") -> Claim:
    begun = await store.begin("acme", key, "fp", owner, lease_s=LEASE_S)
    assert isinstance(begun, Claim)
    return begun


async def settled() -> None:
    """Let the row's callbacks run, and the store's writes they start end."""
    await asyncio.sleep(0)
    await asyncio.gather(*idempotency._FOLLOWING)


async def test_an_answer_whose_row_commits_after_the_claims_lease_is_kept(store: RedisIdempotency) -> None:
    claim = await claimed(store, "order-1")
    row: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    store.finish_when_written(row, claim, ANSWER, ttl_s=60)
    assert isinstance(await store.begin("acme", "order-1", "fp", "req-2", lease_s=LEASE_S), Running)
    await asyncio.sleep(LEASE_S + 0.1)  # the row is still pending when the claim's lease ends ...
    record = store._keys("acme", "order-1")[0]
    seconds, micros = await store._redis.time()
    assert json.loads(await store._redis.get(record))["lease"] <= seconds * 1000 + micros // 1000  # ... not extended
    row.set_result(None)  # the row commits, billed
    await settled()
    again = await store.begin("acme", "order-1", "fp", "req-2", lease_s=LEASE_S)
    assert again == Replay(ANSWER)  # the retry replays what was billed, it does not run again
    assert 50_000 < await store._redis.pttl(record) <= 60_000  # kept for the answer's TTL
    assert store._following == {} and store._following_bytes == 0


async def test_a_row_refused_for_good_gives_the_claim_up(store: RedisIdempotency) -> None:
    claim = await claimed(store, "order-2")
    row: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    store.finish_when_written(row, claim, ANSWER, ttl_s=60)
    row.set_exception(RuntimeError("the database refused the row"))
    await settled()
    assert isinstance(await store.begin("acme", "order-2", "fp", "req-2", lease_s=LEASE_S), Claim)  # the retry runs


async def test_what_waits_for_rows_is_bounded_and_not_kept_past_close(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(idempotency_redis, "MAX_OWED", 1)
    store = RedisIdempotency(redis_url)
    loop = asyncio.get_running_loop()
    first, second = await claimed(store, "order-3"), await claimed(store, "order-4")
    rows: list[asyncio.Future[None]] = [loop.create_future(), loop.create_future()]
    store.finish_when_written(rows[0], first, ANSWER, ttl_s=60)
    with caplog.at_level(logging.ERROR, logger="tiergate.idempotency"):
        store.finish_when_written(rows[1], second, ANSWER, ttl_s=60)  # over the bound: dropped, left to its lease
        assert "is dropped" in caplog.text
        assert list(store._following) == [first]
        await store.close()
        assert "1 answers whose ledger rows are still pending" in caplog.text
    rows[0].set_result(None)  # committed after the store closed: nothing is written (its claim ends with its lease)
    await settled()
    assert store._following == {}


async def test_a_sql_store_gives_the_claim_of_a_late_row_refused_for_good_up(tmp_path: Path) -> None:
    """SQLite (PostgreSQL alike, the same default): the answer commits with the row, so only a refusal needs it."""
    store = SQLiteIdempotency(tmp_path / "ledger.sqlite3")
    try:
        claim = await store.begin("acme", "order-5", "fp", "req-1", lease_s=600)
        assert isinstance(claim, Claim)
        row: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        store.finish_when_written(row, claim, ANSWER, ttl_s=60)
        assert isinstance(await store.begin("acme", "order-5", "fp", "req-2", lease_s=600), Running)
        row.set_exception(RuntimeError("the database refused the row"))
        await settled()
        assert isinstance(await store.begin("acme", "order-5", "fp", "req-2", lease_s=600), Claim)
    finally:
        await store.close()
