"""The mark a row settled on a quota fallback carries (quotas/backends/journal.py `fallback_mark`): its day and scopes
come back from it as they went in, and a scope the mark cannot hold (one with a comma, which separates the scopes) is
refused there, its request settled through the failover's own journal instead. Real redis-server."""

from __future__ import annotations

import asyncio
import calendar
import signal
import time
from pathlib import Path

import pytest

from quotas.backends.journal import fallback_mark, fallback_row
from quotas.backends.redis import RedisBackend
from quotas.ledger import Ledger
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.seed import LedgerFallbackRows
from tests.conftest import RedisServer
from tests.quotas.test_failover import admit, failover, reserve
from tests.quotas.test_failover_durable import marked_row


def request(*scopes: str) -> ReservationRequest:
    return ReservationRequest("r1", "acme", tuple(ScopeLimits(s, budget_day_pico=1000) for s in scopes), 10, 100,
                              now=calendar.timegm((2026, 12, 5, 12, 0, 0)))


def test_a_mark_gives_back_its_day_and_scopes() -> None:
    for scopes in (("t",), ("t", "k:0a1b2c"), ("t", "k:a:b")):  # a key's scope holds a colon: the mark keeps it
        row = fallback_row("r1", "acme", 70, fallback_mark(request(*scopes), sent=False))
        assert (row.scopes, row.day, row.month, row.pico, row.by_id) == (scopes, "20261205", "202612", 70, False)
    assert fallback_row("r1", "acme", 70, fallback_mark(request("t"), sent=True)).by_id


def test_a_scope_with_a_comma_is_refused() -> None:
    with pytest.raises(ValueError, match="'k:a,b'"):
        fallback_mark(request("t", "k:a,b"), sent=False)


async def test_a_request_whose_scope_the_mark_cannot_hold_is_settled_once_from_the_journal(
        own_redis: RedisServer, tmp_path: Path) -> None:
    """Its row goes unmarked (nothing for the rows' flush to apply), and its settle journals its money in memory, to
    each of its scopes once."""
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    rows = LedgerFallbackRows(ledger)
    b = failover(own_redis.url, rows=rows)
    scopes = (ScopeLimits("t", budget_day_pico=1000), ScopeLimits("k:a,b", budget_day_pico=1000))
    marks = []
    try:
        assert (await admit(b, 100, settle_to=100)).admitted
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            for kind in ("id", "sum"):  # its reserve sent to Redis (which runs it once thawed), then one that was not
                r = ReservationRequest(f"odd-{kind}", "acme", scopes, 10, 100, dated_at=time.time())
                decision = await reserve(b, r)
                assert decision.admitted and not b.up
                marks.append(decision.fallback)
                await ledger.record(marked_row(r.request_id, 70, decision.fallback))  # as settle.py writes it
                await b.settle(r, tokens=1, money_pico=70)
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(b.retry_every_s)
        await b.reap()
        await b.reap()
        probe = RedisBackend(own_redis.url, timeout_s=1.0)
        try:
            spent = await probe.spent("acme", ["t", "k:a,b", "k:a", "b"], time.time())
        finally:
            await probe.close()
        assert spent is not None
        assert {scope: day for scope, (day, _) in spent.items()} == {"t": 100 + 2 * 70, "k:a,b": 2 * 70, "k:a": 0,
                                                                     "b": 0}
        assert marks == [None, None] and await rows.pending(10) == [] and len(b.journal) == 0
    finally:
        await b.close()
        ledger.close()
