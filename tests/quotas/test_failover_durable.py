"""Money a replica settled on its fallback during a Redis outage reaches Redis' counters exactly once even if the
replica dies before Redis is back: its ledger rows carry the mark, and any replica applies them. Real
redis-servers; the replica that dies is a real process killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.app import build_quota_backend
from gateway.settings import Settings
from quotas.backends.failover import FailoverBackend
from quotas.ledger import Ledger
from quotas.ledger_rows import LedgerRow
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.money import from_pico
from quotas.seed import LedgerFallbackRows, ledger_billing
from tests.conftest import RedisServer
from tests.quotas.test_failover import admit, failover, redis_spend

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
                for _ in range(200):
                    try:
                        decision = await dying.reserve(r)
                        break
                    except Exception:
                        await asyncio.sleep(0.02)
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
