"""Tenants, keys and data versions in SQLite (WAL) under the data directory: the embedded store.

The rules are gateway/tenants/store.py's `TenantStore` (`TenantStore(path)` opens this one). Another
connection's commit (the CLI, another gateway process of this host) changes `PRAGMA data_version`, which a
request reads when the last reading is FOLLOW_EVERY_S old, so a revocation takes effect within that. Not on every
request: the query lets go of the GIL, and under load the event loop then waits for the worker threads to give it
back (py-spy showed it among the largest costs of an exact cache hit under load).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway.tenants.store import TenantStore

FOLLOW_EVERY_S = 0.02  # seconds; a change made by another connection is seen within this

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
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


class SQLiteTenantStore(TenantStore):
    """The embedded store: one SQLite file, `path` (the data directory's state.db)."""

    _conflict = (sqlite3.IntegrityError,)

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._conn = connect(path)
        self._conn.executescript(SCHEMA)
        columns = {r[1] for r in self._conn.execute("PRAGMA table_info(api_keys)")}
        if "limits" not in columns:  # a data directory from before per-key limits
            self._conn.execute("ALTER TABLE api_keys ADD COLUMN limits TEXT")
        self._version = self._data_version()
        self._checked_at = time.monotonic()

    def close(self) -> None:
        self._conn.close()

    def _fetchone(self, sql: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        return self._conn.execute(sql, args).fetchone()

    def _fetchall(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, args).fetchall()

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        self._conn.execute(sql, args)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
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
