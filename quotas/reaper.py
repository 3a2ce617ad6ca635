"""The reaper: every replica returns, now and then, the reservations whose lease ran out.

A reservation outlives its lease only when the replica that made it died between reserve and settle (or
could not reach the store for longer than it retries a settle). Each round asks the backend to return them
(`QuotaBackend.reap`): a run whose ledger row was written is billed that, anything else is refunded, each
exactly once however many replicas reap at once. A round that fails is logged, and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from quotas.backends.base import Billed, QuotaBackend, QuotaBackendError

log = logging.getLogger("tiergate.quotas")


async def run_reaper(backend: QuotaBackend, *, every_s: float, billed: Billed | None = None,
                     renew: Callable[[], Awaitable[object]] | None = None) -> None:
    """Reap at once (what a replica that died before this one started left behind), then every `every_s`,
    until cancelled; never raises otherwise. `renew`: this replica's running requests' leases, renewed first."""
    while True:
        if renew is not None:
            await _round(renew, "renewing the leases of running requests")
        await _round(lambda: backend.reap(billed), "reaping expired reservations")
        await asyncio.sleep(every_s)


async def _round(work: Callable[[], Awaitable[object]], what: str) -> None:
    try:
        await work()
    except QuotaBackendError as exc:  # the store is down or busy: its failover says so; retry next round
        log.info("%s failed: %s", what, exc)
    except Exception:  # a bug must not stop the rounds that follow
        log.exception("%s failed", what)
