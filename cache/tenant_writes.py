"""The cache's one writer thread, taking tenants in turns: one tenant's flood of new answers delays another
tenant's write by one write per other tenant with writes queued, not by the whole flood.

`SemanticCache.apersist` queues each write under its tenant. The thread takes the first write of the first
tenant in line, then sends that tenant to the back of the line if it has more (round robin, oldest first within
a tenant). Writes are best-effort: a tenant with `per_key` writes already queued (the one being written not
counted) loses its oldest queued one to make room for the new one; the dropped write's future resolves to None
without running it, and `on_drop(key)` counts it. The newest answers are the ones kept, so a repeat sent right
after an answer still finds it (in `PendingWrites` until written, then in the store), and a flood no longer
grows a queue, a memory and a delay without bound. One thread, as before: every write runs under the cache's
lock, so more would only wait on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

from cache.owner_lanes import OwnerLanes

Job = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class TenantWriteQueue:
    """Jobs queued per key (a tenant), run by one thread, the keys in turns. Thread-safe; `submit` holds a lock
    for microseconds, so the event loop may call it."""

    def __init__(self, per_key: int, *, on_drop: Callable[[Hashable], None] = lambda key: None,
                 name: str = "tiergate-cache-write") -> None:
        if per_key < 1:
            raise ValueError("per_key must be at least 1")
        self.on_drop = on_drop
        self.name = name
        # keys in line, each its jobs in order, the oldest dropped past per_key; touched under _cond only
        self._queues: OwnerLanes[Job] = OwnerLanes(per_key)
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False

    def queued(self, key: Hashable) -> int:
        """Jobs of `key` waiting (not the one running)."""
        with self._cond:
            return self._queues.queued(key)

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue `fn(*args)` under `key`; its future. May drop `key`'s oldest queued job (see the module)."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot queue a write after close")
            dropped = self._queues.add(key, (future, fn, args))
            if self._thread is None:
                # a daemon: a cache never closed must not hold the interpreter at exit (a write cut short there is
                # rolled back, and a cache write is best-effort)
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        if dropped is not None:
            if dropped[0].set_running_or_notify_cancel():  # else its caller gave up on it already
                dropped[0].set_result(None)
            self.on_drop(key)
        return future

    def close(self) -> None:
        """Run what is queued, then stop the thread (and wait for it)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queues and not self._closed:
                    self._cond.wait()
                if not self._queues:
                    return  # closed, and nothing left
                future, fn, args = self._queues.take()  # the key goes behind the others if it has more
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued (its apersist was)
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, as an executor does
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args
