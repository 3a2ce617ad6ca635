"""Where response formats are compiled: a few threads of their own, shared fairly between tenants, with a bounded queue.

A grammar compile (engine/grammar.py) can take from a millisecond to seconds of llguidance's CPU before it succeeds
or fails, and a tenant decides what it compiles. On the event loop's default executor, a flood of such schemas from
one tenant held every worker thread, and another tenant's request (its tokenizing, its own compile) waited behind
them. Here compiles run on COMPILE_WORKERS threads of their own; a tenant (the gateway's per-tenant cache salt, as the
scheduler reads it; no salt is one tenant) runs at most one compile at a time, and the next compile to start is the
one of the tenant that started one least recently (round robin; a tenant with nothing pending starts afresh), so
another tenant's compile waits at most for the one running on a worker, and for none while a worker is free. Each
tenant has at most MAX_PENDING_PER_TENANT compiles queued or running, and all tenants together MAX_PENDING; past
either, `submit` raises EngineBusyError at once (HTTP 429 with Retry-After: the engine's server), never waiting. A
caller that leaves (its future cancelled) before its compile starts frees its place.

Callers sharing one compile (the engine's requests for one tenant's new schema) await it through `join`: one that
leaves does not cancel it for the others, and once all have left, a compile that has not started leaves the queue,
never runs and frees its place (before, shielded from every caller, it kept its place and ran for no one: a tenant
could fill its places with requests it abandoned, again and again, and keep the threads busy for nothing). One
already running finishes (its grammar stays cached); its place is free when it ends.

The compile threads run at a lower scheduling priority (COMPILE_NICE, where the OS gives threads their own: Linux):
llguidance releases the GIL while it compiles (a 1,000-property schema: 0.1-0.17 s of its CPU, the event loop's thread
never waited more than 12 ms meanwhile), so what a flood of compiles takes from everyone else is CPU, and on a busy
host the engine's step loop comes first; a tenant's new schema waits for what the steps leave.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any, TypeVar

from wire.errors import COMPILES_BUSY_RETRY_AFTER_S, RESPONSE_FORMAT_COMPILES_BUSY

COMPILE_WORKERS = 2
MAX_PENDING_PER_TENANT = 8  # queued or running (a plan at the gateway caps a tenant's requests in flight: the hostile
# bench's attacker, 8)
MAX_PENDING = 64
RETRY_AFTER_S = COMPILES_BUSY_RETRY_AFTER_S
COMPILE_NICE = 10  # added to a compile thread's nice value: a tenth of the CPU of a thread at 0 when they compete

Tenant = str | None
T = TypeVar("T")


class EngineBusyError(RuntimeError):
    """The engine cannot take this request's work now (too many compiles queued); try again later: HTTP 429."""

    def __init__(self, message: str, *, param: str | None = None, code: str = RESPONSE_FORMAT_COMPILES_BUSY,
                 retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


class CompileQueue:
    """Runs submitted functions on `workers` threads of its own (started on the first submit), fairly between
    tenants; thread-safe."""

    def __init__(self, *, workers: int = COMPILE_WORKERS, per_tenant: int = MAX_PENDING_PER_TENANT,
                 total: int = MAX_PENDING, name: str = "grammar-compile") -> None:
        if workers < 1 or per_tenant < 1 or total < 1:
            raise ValueError("a compile queue needs at least one worker and room for one compile")
        self.workers, self.per_tenant, self.total, self.name = workers, per_tenant, total, name
        self._cond = threading.Condition()  # its lock an RLock: cancelling a job under it runs `_forget`
        self._queues: dict[Tenant, deque[tuple[Callable[[], Any], Future[Any]]]] = {}  # in the order they came
        self._pending: dict[Tenant, int] = {}  # queued or running, per tenant
        self._last_start: dict[Tenant, int] = {}  # while a tenant has compiles pending: when its last one started
        self._starts = 0
        self._running: set[Tenant] = set()
        self._waiters: dict[Future[Any], int] = {}  # a job -> its callers awaiting it in `join`
        # a running job -> its thread's CPU clock and that clock's reading when the job started (longest_running_cpu_s)
        self._began: dict[Future[Any], tuple[int, float]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.num_refused = 0

    def submit(self, tenant: Tenant, fn: Callable[[], Any]) -> Future[Any]:
        """A future of `fn()` run on one of the queue's threads; EngineBusyError when the tenant's share or the
        queue is full."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise EngineBusyError("the engine is shutting down", param="response_format")
            pending = self._pending.get(tenant, 0)
            if pending >= self.per_tenant or sum(self._pending.values()) >= self.total:
                self.num_refused += 1
                whose = "this tenant's" if pending >= self.per_tenant else "the engine's"
                raise EngineBusyError(f"response_format: {whose} grammar compiles are all taken (at most "
                                      f"{self.per_tenant if pending >= self.per_tenant else self.total} waiting); "
                                      f"try again in {RETRY_AFTER_S} s", param="response_format")
            self._pending[tenant] = pending + 1
            self._queues.setdefault(tenant, deque()).append((fn, future))
            if len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        future.add_done_callback(lambda f: self._forget(tenant, f) if f.cancelled() else None)
        return future

    async def join(self, future: Future[T]) -> T:
        """The result of a job `submit` returned, for one of the callers sharing it: a caller that leaves (its task
        cancelled) does not cancel the job for the others; the last one to leave cancels it, which takes a job that
        has not started out of the queue (a running one finishes)."""
        with self._cond:
            self._waiters[future] = self._waiters.get(future, 0) + 1
        waiter = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(waiter)
        finally:
            with self._cond:  # under the lock: no caller joins a job between its last leaving and the cancel
                if num_left := self._waiters.pop(future) - 1:
                    self._waiters[future] = num_left
                else:
                    future.cancel()  # a no-op once it runs or is done
            # a job that fails after its callers left: its exception read, not logged as never retrieved
            waiter.add_done_callback(lambda w: w.cancelled() or w.exception())

    def _forget(self, tenant: Tenant, future: Future[Any]) -> None:
        """A job cancelled before a worker took it leaves the queue at once."""
        with self._cond:
            jobs = self._queues.get(tenant)
            for job in jobs or ():
                if job[1] is future:
                    jobs.remove(job)  # type: ignore[union-attr]
                    if not jobs:
                        del self._queues[tenant]
                    self._pending[tenant] -= 1
                    if not self._pending[tenant]:
                        del self._pending[tenant]
                        self._last_start.pop(tenant, None)
                    return

    def longest_running_cpu_s(self) -> float:
        """The most CPU time one running compile has used so far (0 when none runs, or where threads have no CPU clock
        of their own): the engine's health reads it, a compile thread being one that cannot be stopped. CPU time, not
        time since it began: compile threads run at a lower priority, so under a busy engine a compile of 0.17 s of
        CPU can take minutes of wall time, and an engine restarted for that would be an outage any tenant could cause
        by sending a schema when the engine is busy. A compile that spins for ever uses CPU all along."""
        with self._cond:  # held only for bookkeeping, never across a compile
            running = list(self._began.values())
        used = 0.0
        for clock, start in running:
            with suppress(OSError):  # the thread ended meanwhile: its compile is over
                used = max(used, time.clock_gettime(clock) - start)
        return used

    def close(self) -> None:
        """No more submits; the threads end once the compiles queued have run."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next(self) -> tuple[Tenant, Callable[[], Any], Future[Any]] | None:
        """Under the lock, waiting for one: the first job of the tenant with no compile running whose last compile
        started least recently (one that has started none first, in the order they came); None once closed and
        empty."""
        while True:
            ready = [t for t in self._queues if t not in self._running]
            if ready:
                tenant = min(ready, key=lambda t: self._last_start.get(t, -1))
                jobs = self._queues[tenant]
                fn, future = jobs.popleft()
                if not jobs:
                    del self._queues[tenant]
                self._starts += 1
                self._last_start[tenant] = self._starts
                return tenant, fn, future
            if self._closed and not self._queues:
                return None
            self._cond.wait()

    def _work(self) -> None:
        try:  # this thread alone (Linux: a thread's id names it to setpriority)
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE)
        except (AttributeError, OSError):  # no per-thread priorities here: compiles run at the caller's
            pass
        while True:
            with self._cond:
                if (job := self._next()) is None:
                    return
                tenant, fn, future = job
                self._running.add(tenant)
            try:
                if future.set_running_or_notify_cancel():  # False: its caller left before it started
                    if (clock := _cpu_clock()) is not None:
                        with self._cond:
                            self._began[future] = (clock, time.clock_gettime(clock))
                    try:
                        result = fn()
                    except BaseException as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._cond:
                    self._began.pop(future, None)
                    self._running.discard(tenant)
                    self._pending[tenant] -= 1
                    if not self._pending[tenant]:
                        del self._pending[tenant]
                        self._last_start.pop(tenant, None)
                    self._cond.notify_all()


def _cpu_clock() -> int | None:
    """The calling thread's CPU-time clock (POSIX), or None where there is none."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None
