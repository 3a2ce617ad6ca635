"""The reaper: every replica returns, now and then, the reservations whose lease ran out.

A reservation outlives its lease only when the replica that made it died between reserve and settle (or
could not reach the store for longer than it retries a settle). Each round asks the backend to return them
(`QuotaBackend.reap`): a run whose ledger row was written is billed that, anything else is refunded, each
exactly once however many replicas reap at once. A round that fails is logged (each fault once in an outage),
and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from quotas.backends.base import Billed, QuotaBackend
from quotas.fault_log import FaultLog

log = logging.getLogger("tiergate.quotas")


async def run_reaper(backend: QuotaBackend, *, every_s: float, billed: Billed | None = None,
                     renew: Callable[[], Awaitable[object]] | None = None) -> None:
    """Reap at once (what a replica that died before this one started left behind), then every `every_s`,
    until cancelled; never raises otherwise. `renew`: this replica's running requests' leases, renewed first.
    In an outage each distinct fault is logged once, then one line when a round works again."""
    renewing = FaultLog(log, "renewing the leases of running requests")
    reaping = FaultLog(log, "reaping expired reservations")
    while True:
        if renew is not None:
            await _round(renew, renewing)
        await _round(lambda: backend.reap(billed), reaping)
        await asyncio.sleep(every_s)


async def _round(work: Callable[[], Awaitable[object]], faults: FaultLog) -> None:
    try:
        await work()
    except Exception as exc:  # the store is down or busy (its failover says so), or a bug: retry next round
        faults.failed(exc)
    else:
        faults.ok()
