"""What the quota state learns from the durable ledger: the embedded state at start-up (budgets and windows
survive a restart), the fallback's starting spend in a Redis outage, and what a reaped reservation billed.

A killed embedded gateway loses its open reservations with its memory. Its restart seeds spend from the
ledger's rows alone, and a run that was never settled has no row: it is not billed, and nothing is counted
twice (a settled run's row is counted once, its reservation being gone).

A re-seed's reads (a tenant's spend, and the fallback rows applied before it) keep a request waiting, so they wait
for another session's lock on the ledger's tables (an operator's LOCK TABLE, an ALTER) at most the ledger's read
lock timeout (TIERGATE_LEDGER_READ_LOCK_TIMEOUT_S), not their 60 s statement timeout. One that gives up is a
retryable `QuotaBackendError` marked back-pressure: the reserve charged nothing and the tenant stays un-seeded (its
next reserve reads again), the request gets a 503 `quota_backend_unavailable` (gateway/pipeline/reserve.py), and the
failover does not take it for Redis down (no fallback from figures that may lack the ledger's spend).
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from quotas.backends.base import Billed, QuotaBackendError
from quotas.backends.failover import LedgerSpend
from quotas.backends.journal import FallbackRow, fallback_row
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import TenantSpend
from quotas.ledger import Ledger, LedgerReadLocked
from quotas.limits import WINDOW_S, Spend
from quotas.money import to_pico

log = logging.getLogger("tiergate.quotas")
LOCKED_LOG_EVERY_S = 60.0  # a read given up on another session's lock is logged at most this often


def seed_from_ledger(memory: MemoryBackend, ledger: Ledger, now: float | None = None) -> int:
    """Load this month's spend, today's spend and the last minute's requests per tenant and key scope.

    Returns the number of ledger rows read.
    """
    now = time.time() if now is None else now
    sums, recent, rows = _sums(ledger, now)
    for (tenant, scope), spend in sums.items():
        memory.seed(tenant, scope, day=spend.day, month=spend.month, spent_day_pico=spend.day_pico,
                    spent_month_pico=spend.month_pico, recent=recent.get((tenant, scope), []))
    return rows


def ledger_spend(ledger: Ledger, now: float) -> dict[tuple[str, str], Spend]:
    """Each tenant's and key scope's spend on `now`'s day and month (UTC), from the ledger's rows."""
    return _sums(ledger, now)[0]


def ledger_spend_source(ledger: Ledger) -> LedgerSpend:
    """`ledger_spend` off the event loop, for `FailoverBackend(ledger_spend=...)`."""
    async def spend(now: float) -> dict[tuple[str, str], Spend]:
        return await asyncio.to_thread(ledger_spend, ledger, now)

    return spend


def tenant_spend(ledger: Ledger, tenant: str, now: float) -> dict[str, Spend]:
    """One tenant's spend per scope ("t", "k:<key id>") on `now`'s day and month (UTC), summed by the ledger
    (its (tenant, ts) index: the tenant's own rows, not everyone's; exact decimals). Raises `LedgerReadLocked`
    where another session's lock held a read past the ledger's read lock timeout: never a spend of rows unread."""
    t = time.gmtime(now)
    month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    day_start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
    day, month = time.strftime("%Y%m%d", t), time.strftime("%Y%m", t)
    sums: dict[str, list[int]] = {}
    with ledger.lock_bounded_reads():
        read = [ledger.request_totals(["key_id"], tenant=tenant, since=since) for since in (month_start, day_start)]
    for i, found in zip((1, 0), read, strict=True):
        for totals in found:
            pico = to_pico(totals.price_usd)
            for scope in ("t", f"k:{totals.group[0]}"):
                sums.setdefault(scope, [0, 0])[i] += pico
    return {scope: Spend(day, month, d, m) for scope, (d, m) in sums.items()}


def tenant_spend_source(ledger: Ledger) -> TenantSpend:
    """`tenant_spend` off the event loop, for `RedisBackend(tenant_spend=...)`; a read given up on a lock is a
    back-pressure `QuotaBackendError` (the module docstring)."""
    locked = _Locked()

    async def spend(tenant: str, now: float) -> dict[str, Spend]:
        try:
            return await asyncio.to_thread(tenant_spend, ledger, tenant, now)
        except LedgerReadLocked as exc:
            raise locked(f"{tenant}'s spend", exc) from exc

    return spend


FALLBACK_ROWS_SINCE_S = 35 * 86_400  # older rows count for no day or month Redis still keeps


class LedgerFallbackRows:
    """The ledger's rows settled on a quota fallback, for `FailoverBackend(rows=...)`: read and noted applied off
    the event loop, every replica's (the SQLite file its host's replicas share, the fleet's Postgres)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._locked = _Locked()

    async def pending(self, limit: int) -> list[FallbackRow]:
        """Read before a re-seed (and at each flush): lock-bounded as `tenant_spend` is, and refused as it is."""
        try:
            found = await asyncio.to_thread(self._pending, time.time() - FALLBACK_ROWS_SINCE_S, limit)
        except LedgerReadLocked as exc:
            raise self._locked("the fallback rows", exc) from exc
        return [fallback_row(rid, tenant, to_pico(price), mark) for rid, tenant, price, mark in found]

    def _pending(self, since: float, limit: int) -> list[Any]:
        with self.ledger.lock_bounded_reads():
            return self.ledger.fallback_pending(since, limit)

    async def applied(self, request_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.ledger.mark_fallback_applied, request_ids)


def ledger_billing(ledger: Ledger) -> Billed:
    """What the ledger billed each request id (picodollars), read off the event loop, for the reapers: a run
    whose row was written before its gateway died is billed that, not refunded."""
    def billed(request_ids: list[str]) -> dict[str, int]:
        out = {}
        for rid in request_ids:
            if (row := ledger.get(rid)) is not None:
                out[rid] = to_pico(row.price_usd)
        return out

    async def read(request_ids: list[str]) -> dict[str, int]:
        return await asyncio.to_thread(billed, request_ids)

    return read


class _Locked:
    """A read given up on another session's lock as the retryable, back-pressure `QuotaBackendError` its caller
    raises (nothing read, nothing charged), logged once a LOCKED_LOG_EVERY_S at most (a held table refuses every
    re-seed)."""

    def __init__(self) -> None:
        self._logged_at = -math.inf
        self._unlogged = 0

    def __call__(self, what: str, exc: LedgerReadLocked) -> QuotaBackendError:
        self._unlogged += 1
        if (at := time.monotonic()) - self._logged_at >= LOCKED_LOG_EVERY_S:
            log.warning("ledger: %s not read, another session held a lock (%d such reads since the last such log; "
                        "nothing charged, a re-seed's request got 503): %s", what, self._unlogged, exc)
            self._logged_at, self._unlogged = at, 0
        return QuotaBackendError(f"ledger: {what} not read, the ledger's tables are locked by another session; "
                                 "retry shortly", transient=True, back_pressure=True)


def _sums(ledger: Ledger, now: float) -> tuple[dict[tuple[str, str], Spend],
                                               dict[tuple[str, str], list[tuple[float, str, int]]], int]:
    t = time.gmtime(now)
    month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    day_start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
    day, month = time.strftime("%Y%m%d", t), time.strftime("%Y%m", t)
    sums: dict[tuple[str, str], list[int]] = {}
    # (tenant, scope) -> request id -> [ts, request id, tokens]: the last minute's client requests
    recent: dict[tuple[str, str], dict[str, list[Any]]] = {}
    follow_ons: list[tuple[tuple[str, str], str, str]] = []  # (key, a cascade's retry, the attempt it continues)
    rows = 0
    for row in ledger.each_row(since=month_start):  # the month's rows a batch at a time, not all at once
        rows += 1
        for scope in ("t", f"k:{row.key_id}"):
            key = (row.tenant, scope)
            s = sums.setdefault(key, [0, 0])
            pico = to_pico(row.price_usd)
            s[1] += pico
            if row.ts >= day_start:
                s[0] += pico
            if row.ts > now - WINDOW_S:
                recent.setdefault(key, {})[row.request_id] = [row.ts, row.request_id,
                                                              row.input_tokens + row.output_tokens]
                if row.cascade_of is not None:
                    follow_ons.append((key, row.request_id, row.cascade_of))
    # a cascade's retry took no place of its own in the live window (ReservationRequest.follows): its tokens join its
    # first attempt's entry, where that is in the window (else it keeps its own, erring towards the limit)
    for key, rid, first in follow_ons:
        entries = recent[key]
        if first in entries and rid in entries:
            entries[first][2] += entries.pop(rid)[2]
    spend = {key: Spend(day, month, d, m) for key, (d, m) in sums.items()}
    return spend, {key: [(ts, rid, tokens) for ts, rid, tokens in entries.values()]
                   for key, entries in recent.items()}, rows
