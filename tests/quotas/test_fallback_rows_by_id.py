"""A fallback's ledger row applied by its request id (its reserve was sent to Redis) reaches Redis' counters once,
however late it is sent again: when its note "applied" in the ledger keeps failing, or a replica killed between the
apply and the note restarts after the settle's tombstone expired (15 minutes). Real redis-server."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.journal import FallbackRow
from quotas.backends.redis import RedisBackend


class _NoteFails:
    """Ledger rows whose note "applied" cannot be written (disk full, a read-only standby): pending every flush."""

    def __init__(self, row: FallbackRow) -> None:
        self.row = row

    async def pending(self, limit: int) -> list[FallbackRow]:
        return [self.row]

    async def applied(self, request_ids: Sequence[str]) -> None:
        raise OSError("database or disk is full")


async def test_a_by_id_row_sent_again_after_its_tombstone_expired_adds_nothing(redis_url: str) -> None:
    day = time.strftime("%Y%m%d", time.gmtime())
    row = FallbackRow("req-1", "acme", ("t",), day, day[:6], 1_000_000, True)
    fb = FailoverBackend(RedisBackend(redis_url, timeout_s=0.5), rows=_NoteFails(row))
    r = fb.primary.redis
    try:
        for _ in range(3):
            with pytest.raises(OSError):  # the note failed: the row is pending again next flush
                await fb.flush_journal()
            await r.delete(fb.primary.record_key("acme", "req-1"))  # its settle's tombstone expired meanwhile
            assert int(await r.get(f"{{tg:acme}}:t:month:{day[:6]}")) == 1_000_000
            assert int(await r.get(f"{{tg:acme}}:t:day:{day}")) == 1_000_000
        assert fb.num_journal_rows == 1
    finally:
        await fb.close()


async def test_a_row_whose_apply_failed_is_applied_by_its_retry(redis_url: str) -> None:
    """settle.lua's error after a write keeps that write (Redis does not undo a script's writes): the row's marker,
    set before the row applied, made every retry a no-op and the row's money was never counted."""
    day = time.strftime("%Y%m%d", time.gmtime())
    row = FallbackRow("req-1", "acme", ("t",), day, day[:6], 1_000_000, True)
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        await b.redis.set(b.record_key("acme", "req-1"), "x")  # a fault: the record is no hash, the apply fails
        with pytest.raises(QuotaBackendError):
            await b.settle_row_elsewhere(row)
        assert not await b.redis.exists("{tg:acme}:jrow:req-1")
        await b.redis.delete(b.record_key("acme", "req-1"))
        assert await b.settle_row_elsewhere(row)  # the retry applies it, once
        assert not await b.settle_row_elsewhere(row)
        assert int(await b.redis.get(f"{{tg:acme}}:t:month:{day[:6]}")) == 1_000_000
        assert await b.redis.ttl("{tg:acme}:jrow:req-1") > 86_400
    finally:
        await b.close()


async def test_rows_and_batches_whose_apply_failed_are_applied_by_their_retry(redis_url: str) -> None:
    """journal_rows.lua and journal.lua set their markers last, as settle.lua does: a marker set before the money
    (SET NX first) stayed after an error partway, and the row's or batch's money was never counted."""
    day = time.strftime("%Y%m%d", time.gmtime())
    month_key = f"{{tg:acme}}:t:month:{day[:6]}"
    row = FallbackRow("req-2", "acme", ("t",), day, day[:6], 1_000_000, False)
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        await b.redis.rpush(month_key, "x")  # a fault: the month counter is no number, the apply fails there
        with pytest.raises(QuotaBackendError):
            await b.apply_rows("acme", [row])
        with pytest.raises(QuotaBackendError):
            await b.apply_journal("batch-1", "acme", [("t", day, day[:6], 1_000_000)])
        assert not await b.redis.exists("{tg:acme}:jrow:req-2", "{tg:acme}:jnl:batch-1")
        await b.redis.delete(month_key)
        assert await b.apply_rows("acme", [row]) == 1 and await b.apply_rows("acme", [row]) == 0
        assert await b.apply_journal("batch-1", "acme", [("t", day, day[:6], 1_000_000)])
        assert not await b.apply_journal("batch-1", "acme", [("t", day, day[:6], 1_000_000)])
        assert int(await b.redis.get(month_key)) == 2_000_000  # each once
    finally:
        await b.close()
