"""Usage reports run off the event loop and out of the gateway's interpreter, one at a time per tenant.

A report reads and sums a tenant's whole history: seconds of work for a busy tenant, which must not run on the
event loop. Run on asyncio's default executor (six threads on two cores), eight reports from one tenant held
every thread the request path uses (the cache's lookups, the seed's ledger reads), and another tenant's
cached request waited on them (tests/gateway/test_shared_threads.py). Here reports have threads of their own,
a tenant has at most one report running, and at most `limit` tenants' reports run or wait in all; a report past
either bound is refused at once with a 429 that names it, before any row is read.

The admin's reports (any tenant, or all: the dashboard's finance view) have one slot and one thread of their
own, outside the tenants' `limit` and threads: tenants holding every slot neither refuse nor delay them.

On its thread a report only waits: it is read and summed in a report process (quotas/report_worker.py) on a
read-only connection of its own. Summed on the thread, it held the gateway's interpreter (the GIL) while it ran:
500k rows, 3.2 s a report, and another tenant's cache hits went from 4.2 to 14.7 ms at p95 while one tenant
looped its `/v1/usage`.

A slot is held until the report's thread is done with it, not until its client leaves: a client that
disconnects and asks again does not stack reports behind the first.

A ledger read the database cannot answer now (`quotas.ledger_reads.read_fault`: PostgreSQL down, a read cancelled at
its statement timeout, SQLite's file locked) is a 503 `ledger_unavailable` with Retry-After (`read`), for reports and
/admin/ops alike, not a 500; the driver's words go to the log, once an outage (quotas/fault_log.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from gateway.errors import RateLimited, Unavailable
from quotas.fault_log import FaultLog
from quotas.ledger import Ledger
from quotas.ledger_reads import read_fault
from quotas.report_worker import TASKS_PER_PROCESS, ReportProcesses

T = TypeVar("T")
ADMIN_SLOT = "*admin*"  # admin reports (any tenant, or all) share one slot, outside the tenants' limit
LEDGER_READ_MESSAGE = "the usage ledger cannot be read now; retry shortly"  # a fixed sentence: no driver's words
LEDGER_READ_RETRY_S = 5
log = logging.getLogger("tiergate.report")


class ReportGate:
    def __init__(self, *, threads: int = 2, limit: int = 8, tasks_per_process: int = TASKS_PER_PROCESS) -> None:
        """`threads` run tenants' reports (the admin's has one more); `limit` bounds the tenants' reports
        running or waiting; each is read and summed in a report process, replaced after `tasks_per_process`."""
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiergate-report")
        self._admin_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergate-report-admin")
        self._limit = limit
        self._held: set[str] = set()  # tenants (and ADMIN_SLOT) whose report runs or waits
        self._lock = threading.Lock()  # the slots are released from the report's own thread
        self.processes = ReportProcesses(tasks=tasks_per_process)
        self._read_faults = FaultLog(log, "reading the usage ledger (usage reports, /admin/ops)", rounds="reads")

    async def report(self, who: str, ledger: Ledger, **query: Any) -> list[dict[str, Any]]:
        """`usage_report(ledger, **query)` once `who` holds its slot (see `run`), in a report process."""
        return await self.read(self.run(who, partial(self.processes.report, ledger.read_source(), **query)))

    async def read(self, reading: Awaitable[T]) -> T:
        """`reading`'s result; a database fault of the ledger's read (`read_fault`) as Unavailable: a 503
        `ledger_unavailable` with Retry-After and a fixed sentence, the fault logged once an outage."""
        try:
            result = await reading
        except Exception as exc:
            if not read_fault(exc):
                raise
            self._read_faults.failed(exc)
            raise Unavailable(LEDGER_READ_MESSAGE, code="ledger_unavailable", retry_after=LEDGER_READ_RETRY_S) from None
        self._read_faults.ok()
        return result

    async def run(self, who: str, work: Callable[[], T]) -> T:
        """`work()` on a report thread, once `who` (a tenant, or ADMIN_SLOT) holds its slot; RateLimited if not."""
        with self._lock:
            if who in self._held:
                raise RateLimited("a usage report for this tenant is still running; retry when it is done",
                                  retry_after=1)
            if who != ADMIN_SLOT and len(self._held - {ADMIN_SLOT}) >= self._limit:
                raise RateLimited(f"{self._limit} usage reports are running; retry shortly", retry_after=1)
            self._held.add(who)
        try:
            future = (self._admin_pool if who == ADMIN_SLOT else self._pool).submit(work)
        except BaseException:
            self._release(who)
            raise
        future.add_done_callback(lambda _: self._release(who))
        return await asyncio.wrap_future(future)

    def _release(self, who: str) -> None:
        with self._lock:
            self._held.discard(who)

    def close(self) -> None:
        """Reports not started are dropped; running ones are stopped (their processes killed) or, on a thread,
        finish there."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._admin_pool.shutdown(wait=False, cancel_futures=True)
        self.processes.close()
