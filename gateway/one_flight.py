"""A blocking read the event loop must not run, on a thread of its own, one at a time per owner: callers that come
while it runs get that run's result (or its error) rather than start another.

/metrics rendered on the event loop (3,000 tenants: 1.2 s blocked a scrape, 12.4 MB), and /admin/ops read its
window on asyncio's default threads, the request path's, one read per poll of every open dashboard tab, with no
bound. Each now has a thread of its own (`OneFlight`), and ten scrapes or polls at once cost one render or read.

The owner is what the result is of (an app's metrics, its ledger): two apps in one process (the tests') never get
each other's. A caller that leaves (its client disconnected) leaves the run to the others: it is never cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast
from weakref import WeakKeyDictionary

T = TypeVar("T")


class OneFlight:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._running: WeakKeyDictionary[Any, Future[Any]] = WeakKeyDictionary()  # owner -> its run, while it runs
        self._lock = threading.Lock()  # a run's end is noted on its thread

    async def run(self, owner: Any, call: Callable[[], T]) -> T:
        """`call()` on this flight's thread, unless a run for `owner` is under way: then that run's result."""
        with self._lock:
            running = self._running.get(owner)
            started = running is None
            if running is None:
                running = self._running[owner] = self._pool.submit(call)
        if started:  # outside the lock: a run already done calls `_ended` at once, here
            running.add_done_callback(lambda done: self._ended(owner, done))
        # shielded: a caller cancelled (its client gone) must not cancel the run the others wait on
        return cast(T, await asyncio.shield(asyncio.wrap_future(running)))

    def _ended(self, owner: Any, run: Future[Any]) -> None:
        with self._lock:
            if self._running.get(owner) is run:
                del self._running[owner]
