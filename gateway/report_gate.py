"""Usage reports run on threads of their own, one at a time per tenant.

A report reads and sums a tenant's whole history: seconds of work for a busy tenant, which must not run on the
event loop. Run on asyncio's default executor (six threads on two cores), eight reports from one tenant held
every thread the request path uses (the cache's lookups, the seed's ledger reads), and another tenant's
cached request waited on them (tests/gateway/test_shared_threads.py). Here reports have a pool of their own, a
tenant has at most one report running, and at most `limit` run or wait in all; a report past either bound
is refused at once with a 429 that names it, before any row is read.

A slot is held until the report's thread is done with it, not until its client leaves: a client that
disconnects and asks again does not stack reports behind the first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.errors import RateLimited

T = TypeVar("T")
ADMIN_SLOT = "*admin*"  # admin reports (any tenant, or all) share one slot


class ReportGate:
    def __init__(self, *, threads: int = 2, limit: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiergate-report")
        self._limit = limit
        self._held: set[str] = set()
        self._lock = threading.Lock()  # the slots are released from the report's own thread

    async def run(self, who: str, work: Callable[[], T]) -> T:
        """`work()` on a report thread, once `who` (a tenant, or ADMIN_SLOT) holds its slot; RateLimited if not."""
        with self._lock:
            if who in self._held:
                raise RateLimited("a usage report for this tenant is still running; retry when it is done",
                                  retry_after=1)
            if len(self._held) >= self._limit:
                raise RateLimited(f"{self._limit} usage reports are running; retry shortly", retry_after=1)
            self._held.add(who)
        try:
            future = self._pool.submit(work)
        except BaseException:
            self._release(who)
            raise
        future.add_done_callback(lambda _: self._release(who))
        return await asyncio.wrap_future(future)

    def _release(self, who: str) -> None:
        with self._lock:
            self._held.discard(who)

    def close(self) -> None:
        """Reports not started are dropped; running ones finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)

