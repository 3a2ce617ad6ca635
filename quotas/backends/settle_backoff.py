"""A settle's retries: waiting twice as long each time, up to SETTLE_BACKOFF_S[1], for a given time. Used by the Redis
backend for a settle or cancel Redis did not answer (quotas/backends/redis_retries.py) and by the quota service for a
backend's settle that raised all the same (quotas/reservations.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from quotas.backends.base import QuotaBackendError

SETTLE_BACKOFF_S = (0.05, 5.0)  # first and longest wait between a failed settle's retries


async def retry(call: Callable[[], Awaitable[Any]], wait: float, for_s: float, *,
                retried: tuple[type[Exception], ...] = (QuotaBackendError,)) -> bool:
    """`call` until it works (True), waiting `wait` first and twice as long each time up to SETTLE_BACKOFF_S[1],
    for `for_s` seconds (False after); a failure other than `retried` raises."""
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        await asyncio.sleep(wait)
        try:
            await call()
        except retried:
            wait = min(2 * wait, SETTLE_BACKOFF_S[1])
        else:
            return True
    return False
