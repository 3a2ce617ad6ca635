"""The tenant store's lookups' bound on a wait for another session's lock, carried by its pool's connections.

A lookup (or data-version read) waits for another session's lock (an operator's LOCK TABLE, a long ALTER) at most
its `lock_timeout` (TIERGATE_TENANT_LOOKUP_LOCK_TIMEOUT_S, 0.2 s), then is a `database_busy` 503
(LockNotAvailable): each waited its 5 s statement timeout on one of the store's two lookup threads, so the queue
backed up and every tenant whose key was not cached waited; a slow query not blocked keeps its statement timeout.
Other queries (an admin's change, a rotation's advisory lock, the CLI) wait for locks as before: up to their
statement timeout.

Every pool connection carries the lookups' bound (`configure`, at its making); a query on any thread but a lookup
thread has it RESET (the database's default) and SET again before the connection goes back to the pool (`lifted`).
The pool's connections are autocommit, so each SET, outside any transaction, holds until changed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


class LookupLockTimeout:
    """`lock_timeout_s` as the lookups' bound on a lock wait; 0: none (the statement timeout only)."""

    def __init__(self, lock_timeout_s: float) -> None:
        self.seconds = lock_timeout_s
        self._sql = f"SET lock_timeout = {max(1, int(lock_timeout_s * 1000))}" if lock_timeout_s > 0 else None
        self._thread = threading.local()  # `lookup`: this thread's queries keep the bound

    def configure(self, conn: psycopg.Connection[Any]) -> None:
        """A new pool connection: the lookups' bound."""
        if self._sql is not None:
            conn.execute(self._sql)

    def on_lookup_thread(self) -> None:
        """A lookup thread's initializer: its queries keep the pool's bound."""
        self._thread.lookup = True

    @contextmanager
    def lifted(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """The pool connection `conn` for this thread's query: with the bound on a lookup thread, else without it
        (RESET) until the query is done, then with it again (unless the connection is lost)."""
        if self._sql is None or getattr(self._thread, "lookup", False):
            yield
            return
        conn.execute("RESET lock_timeout")
        try:
            yield
        finally:
            if not conn.closed and not conn.broken:
                conn.execute(self._sql)
