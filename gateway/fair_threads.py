"""A few worker threads shared by every tenant, taken in turns: one tenant's queued work waits on itself.

A plain ThreadPoolExecutor runs work first come, first served. Where every tenant's requests share its
threads (counting long prompts and embeddings inputs, `auto`'s difficulty predictions), one tenant with a
hundred jobs queued made another tenant's one job wait for all hundred. Here each job names its owner (the
tenant); when a thread frees, the next job is the oldest one of the owner after the last one served, in the
order owners first queued: another tenant's job waits for at most one job of each owner ahead of it, plus
those already running.

Only the event loop touches the queues; a thread sees one function call at a time. A job whose caller left
before it started is dropped unrun; one that has started runs to its end (a thread cannot be stopped) and
then frees its thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cache.owner_lanes import OwnerLanes

T = TypeVar("T")
Job = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class FairThreads:
    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._lanes: OwnerLanes[Job] = OwnerLanes()  # owner -> its jobs, next owner first; the event loop's only
        self._running = 0  # jobs in the threads
        self._lock = threading.Lock()  # over `_running`, which a thread whose loop has ended also changes
        self._closed = False

    async def run(self, owner: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in one of the threads, when `owner`'s turn comes."""
        if self._closed:
            raise RuntimeError("these threads are closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._lanes.add(owner, (fn, args, future, loop))  # unbounded: each job has its caller awaiting it
        self._start()
        return await future

    @property
    def queued(self) -> int:
        """Jobs waiting for a thread (for tests and metrics)."""
        return len(self._lanes)

    def close(self) -> None:
        """Jobs not started are cancelled; running ones end in their threads."""
        self._closed = True
        for _, _, future, _ in self._lanes.drain():
            future.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start(self) -> None:
        while self._running < self.threads and self._lanes:
            fn, args, future, loop = self._lanes.take()  # its owner's next job goes behind every other owner's
            if future.done() or loop.is_closed():  # its caller left before its turn
                continue
            with self._lock:
                self._running += 1
            work = self._executor.submit(fn, *args)
            work.add_done_callback(lambda w, f=future, lp=loop: self._done(lp, f, w))

    def _done(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], work: ThreadFuture[Any]) -> None:
        """In the worker thread, as its job ends: the rest on the job's event loop."""
        try:
            loop.call_soon_threadsafe(self._finish, future, work)
        except RuntimeError:  # that loop has ended (a test's), and its caller with it: only the thread is freed
            with self._lock:
                self._running -= 1

    def _finish(self, future: asyncio.Future[Any], work: ThreadFuture[Any]) -> None:
        with self._lock:
            self._running -= 1
        if not future.done():
            if work.cancelled():
                future.cancel()
            elif (error := work.exception()) is not None:
                future.set_exception(error)
            else:
                future.set_result(work.result())
        if not self._closed:
            self._start()

