"""`Readers`: the read connections of a file `SQLiteStore` (cache/sqlite_store.py), kept idle between reads.

A read never waits for a write: it goes through a connection of its own, which WAL lets read the last committed
state while a write transaction is open, in this process or another. At most IDLE_READERS are kept open between
reads; more are opened while more threads read at once, and closed after.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cache.store import CacheStoreError

IDLE_READERS = 8  # read connections kept open between reads; more are opened while more threads read at once


class Readers:
    """Idle read connections to the file at `path` (`connect(path)` opens another), handed out one per read.
    Thread-safe."""

    def __init__(self, path: str, connect: Callable[[str], sqlite3.Connection]) -> None:
        self._path = path
        self._connect = connect
        self._idle: list[sqlite3.Connection] = []  # read connections not in use
        self._idle_lock = threading.Lock()
        self.closed = False

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """An idle read connection (or a new one, read-only), kept for the next read after this one."""
        with self._idle_lock:
            if self.closed:
                raise CacheStoreError("cache store closed")
            db = self._idle.pop() if self._idle else None
        try:
            if db is None:
                db = self._connect(self._path)
                db.execute("PRAGMA query_only=1")
        except sqlite3.Error as exc:
            raise CacheStoreError(f"cannot open cache store {self._path}: {exc}") from exc
        try:
            yield db
        finally:
            with self._idle_lock:
                keep = not self.closed and len(self._idle) < IDLE_READERS
                if keep:
                    self._idle.append(db)
            if not keep:
                db.close()

    def close(self) -> None:
        """Close the idle connections; those in use are closed as their reads end, and no read starts after."""
        with self._idle_lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for db in idle:
            db.close()
