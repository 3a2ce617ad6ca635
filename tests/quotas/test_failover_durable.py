"""Money a replica settled on its fallback during a Redis outage reaches Redis' counters exactly once even if the
replica dies before Redis is back: its ledger rows carry the mark, and any replica applies them. Real
redis-servers; the replica that dies is a real process killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.app import build_quota_backend
from gateway.embeddings_service import EmbeddingsService
from gateway.pipeline.settle import Settler
from gateway.settings import Settings
from quotas.backends.failover import FailoverBackend
from quotas.ledger import Ledger, Pending
from quotas.ledger_rows import CountKey, LedgerRow
from quotas.ledger_sqlite import SQLiteLedger
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.money import from_pico
from quotas.reservations import QuotaService, Reservation
from quotas.seed import LedgerFallbackRows, ledger_billing
from tests.conftest import RedisServer
from tests.quotas.test_failover import admit, failover, redis_spend, reserve

REPLICA = Path(__file__).with_name("fallback_replica.py")
ROOT = Path(__file__).parents[2]


def replica(path: Path, url: str) -> FailoverBackend:
    """A replica's quota backend, built as the gateway builds it."""
    backend = build_quota_backend(Settings(redis_url=url), Ledger(path), SimpleNamespace(redis_state=lambda up: None))
    assert isinstance(backend, FailoverBackend)
    return backend


def marked_row(request_id: str, pico: int, mark: str | None) -> LedgerRow:
    return LedgerRow(request_id=request_id, ts=time.time(), tenant="acme", key_id="k", tier="mid", model="m",
                     status="ok", http_status=200, input_tokens=5, output_tokens=5, price_usd=from_pico(pico),
                     compute_cost_usd=Decimal(0), cost_basis="none", ttft_s=None, total_s=0.1, fallback=mark)


async def test_a_replica_killed_during_an_outage_leaves_its_money_to_the_next_replica(
        own_redis: RedisServer, tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    ledger.start()
    first = replica(path, own_redis.url)
    try:
        assert (await admit(first, 100, settle_to=100)).admitted  # through Redis: the tenant is seeded there
    finally:
        await first.close()
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)  # an outage that keeps Redis' data
    child = subprocess.Popen([sys.executable, str(REPLICA), str(path), own_redis.url, "acme", "3", "60"],
                             cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout=60)
        assert line.split() == [b"SETTLED", b"False"]  # three rows settled on its fallback, Redis still down
    finally:
        child.send_signal(signal.SIGKILL)  # its memory, and any journal there, is gone
        child.wait()
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert await redis_spend(own_redis.url) == 100
    a, b = replica(path, own_redis.url), replica(path, own_redis.url)
    try:
        await asyncio.gather(a.reap(ledger_billing(ledger)), b.reap(ledger_billing(ledger)))  # their reaper rounds
        assert await redis_spend(own_redis.url) == 100 + 3 * 60
        assert a.num_journal_rows + b.num_journal_rows == 3  # each row by one of them
        await a.reap(ledger_billing(ledger))
        assert await redis_spend(own_redis.url) == 100 + 3 * 60  # once
        assert await LedgerFallbackRows(ledger).pending(10) == []
    finally:
        await a.close()
        await b.close()
        ledger.close()


async def test_a_crash_between_applying_rows_and_noting_them_applied_adds_them_once(
        own_redis: RedisServer, tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    rows = LedgerFallbackRows(ledger)
    dying = failover(own_redis.url, rows=rows)
    assert own_redis.proc is not None
    try:
        assert (await admit(dying, 100, settle_to=100)).admitted
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(2):
                r = ReservationRequest(f"r{i}", "acme", (ScopeLimits("t", budget_day_pico=1000),), 10, 100)
                decision = await reserve(dying, r)
                assert decision.admitted and decision.fallback is not None and not dying.up
                await ledger.record(marked_row(r.request_id, 70, decision.fallback))
                await dying.settle(r, tokens=1, money_pico=70)
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)

        async def died_before_the_note(request_ids: object) -> None:
            raise SystemExit("killed")

        dying._rows = SimpleNamespace(pending=rows.pending, applied=died_before_the_note)  # type: ignore[assignment]
        with pytest.raises(SystemExit):
            await dying._flush_rows(dying._rows)  # type: ignore[arg-type]
        assert await redis_spend(own_redis.url) == 100 + 2 * 70  # applied; the ledger does not know
        assert len(await rows.pending(10)) == 2
        other = failover(own_redis.url, rows=rows)
        try:
            await other.reap()
            assert other.num_journal_rows == 0 and await rows.pending(10) == []
            assert await redis_spend(own_redis.url) == 100 + 2 * 70
        finally:
            await other.close()
    finally:
        dying._rows = None  # abandoned: nothing of it is closed
        ledger.close()


async def test_a_row_whose_reserve_redis_may_hold_replaces_that_reservation_after_its_replica_died(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis ran the reserve (600 held) but its answer was lost; the fallback admitted it and its row says 250. Its
    replica dies: the next replica's flush settles that id to 250, not 600 + 250."""
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    rows = LedgerFallbackRows(ledger)
    dying = failover(redis_url, rows=rows)
    real = dying.primary._scripts["reserve"]

    async def ran_then_connection_closed(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        await real(keys=keys, args=args)
        raise RedisConnectionError("Connection closed by server.")

    monkeypatch.setattr(dying.primary, "_cancel_lost", lambda r: asyncio.sleep(0))  # lost with the replica
    monkeypatch.setitem(dying.primary._scripts, "reserve", ran_then_connection_closed)
    r = ReservationRequest("unanswered", "acme", (ScopeLimits("t", budget_day_pico=1000),), 10, 600)
    decision = await dying.reserve(r)
    assert decision.admitted and not dying.up and (decision.fallback or "").startswith("id:")
    await ledger.record(marked_row("unanswered", 250, decision.fallback))
    await dying.settle(r, tokens=1, money_pico=250)
    assert await redis_spend(redis_url) == 600  # the upper bound Redis holds
    other = failover(redis_url, rows=rows)
    try:
        await other.reap()
        assert await redis_spend(redis_url) == 250
        await other.reap()
        assert await redis_spend(redis_url) == 250 and await rows.pending(10) == []
    finally:
        await other.close()
        ledger.close()


async def test_redis_that_lost_its_data_counts_pending_rows_once(own_redis: RedisServer, tmp_path: Path) -> None:
    """The re-seed raises counters to the ledger's totals, which hold the marked rows: the flush before it applies
    them first (max(held, total) then adds nothing), and the rows are noted applied, not added again later."""
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    path = tmp_path / "ledger.sqlite3"
    await ledger.record(marked_row("dead-1", 80, "sum:" + time.strftime("%Y%m%d", time.gmtime()) + ":t"))
    own_redis.flush()  # Redis lost its data (the counters and the seeded marks)
    b = replica(path, own_redis.url)
    try:
        assert (await admit(b, 0, settle_to=0)).admitted  # the tenant's first reserve re-seeds it
        await b.reap(ledger_billing(ledger))
        assert await redis_spend(own_redis.url) == 80
        assert await LedgerFallbackRows(ledger).pending(10) == []
    finally:
        await b.close()
        ledger.close()


class RefusingLedger(SQLiteLedger):
    """Refuses every row the writer commits, as a database refuses a value it cannot hold (`record_now` still
    writes: a test's way to put a row there after all)."""

    def _commit(self, conn: sqlite3.Connection, rows: list[Pending], counts: Counter[CountKey], *, prune: bool,
                isolate: bool) -> list[Exception | None]:
        return [sqlite3.IntegrityError("refused") for _ in rows]


async def chat_settle(ledger: Ledger, quotas: QuotaService, written: asyncio.Future[None], reservation: Reservation,
                      row: LedgerRow) -> None:
    """What gateway/pipeline/settle.py does once the row is queued (its `_settle_quota`, on a stand-in Settler)."""
    host = SimpleNamespace(ledger=ledger, quotas=quotas)
    await Settler._settle_quota(host, written, SimpleNamespace(reservation=reservation), 1, row.price_usd)  # type: ignore[arg-type]


async def embeddings_settle(ledger: Ledger, quotas: QuotaService, written: asyncio.Future[None],
                            reservation: Reservation, row: LedgerRow) -> None:
    """What gateway/embeddings_service.py does once the row is queued."""
    host = SimpleNamespace(ledger=ledger, quotas=quotas)
    await EmbeddingsService._settle_quota(host, written, reservation, 1, row)  # type: ignore[arg-type]


async def settle_refused_rows(b: FailoverBackend, ledger: Ledger, settle_quota: Any, prefix: str,
                              own_redis: RedisServer) -> list[LedgerRow]:
    """With Redis frozen: admit two requests on the fallback (the first's reserve was sent to Redis, which runs it
    once thawed: its row is applied by its id; the second's was not: a sum), queue their marked rows, which the
    ledger refuses, and settle their quotas as the gateway does."""
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)
    out = []
    try:
        for kind in ("id", "sum"):
            r = ReservationRequest(f"{prefix}-{kind}", "acme", (ScopeLimits("t", budget_day_pico=1000),), 10, 100)
            decision = await reserve(b, r)
            assert decision.admitted and not b.up and (decision.fallback or "").startswith(f"{kind}:")
            row = marked_row(r.request_id, 70, decision.fallback)
            written = ledger.submit(row)
            await settle_quota(ledger, QuotaService(b), written, Reservation(r, decision), row)
            assert written.exception() is not None  # refused: no row carries its money
            out.append(row)
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    await asyncio.sleep(b.retry_every_s)  # its next reaper round tries Redis again
    return out


@pytest.mark.parametrize("settle_quota", [chat_settle, embeddings_settle], ids=["chat", "embeddings"])
async def test_money_of_a_request_whose_row_the_ledger_refused_reaches_redis_once(
        own_redis: RedisServer, tmp_path: Path, settle_quota: Any) -> None:
    """Its row was to carry its money to Redis and the ledger refused it: the failover carries it itself."""
    ledger = RefusingLedger(tmp_path / "ledger.sqlite3")
    ledger.start()
    b = failover(own_redis.url, rows=LedgerFallbackRows(ledger))
    try:
        assert (await admit(b, 100, settle_to=100)).admitted
        await settle_refused_rows(b, ledger, settle_quota, "refused", own_redis)
        await b.reap()
        assert await redis_spend(own_redis.url) == 100 + 2 * 70  # the first's reservation replaced, not added to
        await b.reap()
        assert await redis_spend(own_redis.url) == 100 + 2 * 70 and len(b.journal) == 0
    finally:
        await b.close()
        ledger.close()


async def test_a_refused_row_the_ledger_kept_after_all_is_applied_once(own_redis: RedisServer, tmp_path: Path) -> None:
    """A commit whose answer was lost (the rows are there, their futures say refused): the failover's own copies and
    the ledger's rows are applied under the same ids, once."""
    ledger = RefusingLedger(tmp_path / "ledger.sqlite3")
    ledger.start()
    rows = LedgerFallbackRows(ledger)
    b = failover(own_redis.url, rows=rows)
    try:
        assert (await admit(b, 100, settle_to=100)).admitted
        ledger.record_now(await settle_refused_rows(b, ledger, chat_settle, "kept", own_redis))
        assert len(await rows.pending(10)) == 2
        await b.reap()
        await b.reap()
        assert await redis_spend(own_redis.url) == 100 + 2 * 70 and await rows.pending(10) == []
    finally:
        await b.close()
        ledger.close()
