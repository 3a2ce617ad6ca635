"""Tenants, keys and data versions in SQLite (WAL) under the data directory: the embedded store.

The rules are gateway/tenants/store.py's `TenantStore` (`TenantStore(path)` opens this one). Another
connection's commit (the CLI, another gateway process of this host) changes `PRAGMA data_version`, which a
request reads when the last reading is FOLLOW_EVERY_S old, so a revocation takes effect within that. Not on every
request: the query lets go of the GIL, and under load the event loop then waits for the worker threads to give it
back (py-spy showed it among the largest costs of an exact cache hit under load).

The admin routes' calls (`TenantStore.admin`) run on the store's admin thread with a connection of that thread's
own: a write there waits up to the busy timeout for another writer (the CLI, another process) holding the write
lock, and the event loop's connection, which only reads (WAL: never waiting on a writer), is not held meanwhile (one
connection used by two threads makes each wait for the other's statement). Still waiting at the timeout, the call
is a retryable 503.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway.errors import Unavailable
from gateway.tenants.store import P, T, TenantStore

log = logging.getLogger("tiergate.tenants")

FOLLOW_EVERY_S = 0.02  # seconds; a change made by another connection is seen within this
BUSY_TIMEOUT_S = 5.0  # how long a write waits for another connection's write lock

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    plan TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT REFERENCES tenants(name),
    name TEXT NOT NULL DEFAULT '',
    key_sha256 TEXT NOT NULL,
    roles TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked_at REAL,
    replaced_by TEXT,
    limits TEXT
);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys(tenant);
CREATE TABLE IF NOT EXISTS tenant_data_versions (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name),
    version INTEGER NOT NULL
);
"""


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


class SQLiteTenantStore(TenantStore):
    """The embedded store: one SQLite file, `path` (the data directory's state.db)."""

    _conflict = (sqlite3.IntegrityError,)

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._path = path
        self._conn = connect(path)  # the event loop's (and the CLI's): the admin thread has its own
        self._local = threading.local()  # `conn`: the admin thread's connection
        self._admin_conns: list[sqlite3.Connection] = []
        self._conn.executescript(SCHEMA)
        columns = {r[1] for r in self._conn.execute("PRAGMA table_info(api_keys)")}
        if "limits" not in columns:  # a data directory from before per-key limits
            self._conn.execute("ALTER TABLE api_keys ADD COLUMN limits TEXT")
        self._version = self._data_version()
        self._checked_at = time.monotonic()

    def close(self) -> None:
        self._close_admin()
        for conn in self._admin_conns:
            conn.close()
        self._conn.close()

    def _as_admin(self, action: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        if getattr(self._local, "conn", None) is None:  # the admin thread's first call
            self._local.conn = connect(self._path)
            self._admin_conns.append(self._local.conn)
        try:
            return action(*args, **kwargs)
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise
            # the driver's words ("database is locked") are the log's; the admin reads what to do
            log.warning("tenant store: an admin change waited %g s for another connection's write lock and was not "
                        "made: %s", BUSY_TIMEOUT_S, exc)
            raise Unavailable(f"the tenant store is busy: another writer (a CLI command, another gateway process) "
                              f"held it for {BUSY_TIMEOUT_S:g} s; nothing was changed, retry shortly",
                              code="database_busy", retry_after=1) from exc

    def _here(self) -> sqlite3.Connection:
        """This thread's connection: the admin thread's own, or the store's."""
        return getattr(self._local, "conn", None) or self._conn

    def _fetchone(self, sql: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        return self._here().execute(sql, args).fetchone()

    def _fetchall(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._here().execute(sql, args).fetchall()

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        self._here().execute(sql, args)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        conn = self._here()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _changed_elsewhere(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < FOLLOW_EVERY_S:
            return False
        self._checked_at = now
        version = self._data_version()
        changed, self._version = version != self._version, version
        return changed

    def _data_version(self) -> int:
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])
