"""Where cache entries live: the `CacheStore` boundary and its embedded implementation, `SQLiteStore`.

What crosses this boundary: whole `Entry` rows in, `Entry` rows or entry ids out. The store owns TTL
expiry, the bound on its size (least recently used entries go first) and purges; it returns the ids it
removed so the caller can drop them from its vector index. The vector of each entry is stored with it, so
a restarted process rebuilds its faiss indexes from the store without re-embedding anything. A shared
(Redis) store implements the same methods; `SQLiteStore(":memory:")` serves tests and benchmarks.

SQLite runs in WAL mode with `synchronous=NORMAL`: a crash may lose the last few cache writes, which only
costs a later miss, never a wrong answer.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class CacheStoreError(Exception):
    """The cache store could not be read or written (bad path, disk full, corrupt file)."""


@dataclass(slots=True)
class Entry:
    """One cached answer and everything needed to decide whether it may be served."""

    entry_id: str
    scope_id: str
    tenant: str
    data_version: str
    model_version: str
    exact_key: str  # request_key.RequestKey.exact_key
    partition: str  # scope id + history hash: the faiss partition of its semantic text
    semantic_text: str  # the last user turn, for the guards
    response: str  # the assistant's answer text
    usage: dict[str, Any] = field(default_factory=dict)  # the OpenAI usage of the original answer
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. finish_reason, the tier and model that answered
    created_at: float = 0.0
    expires_at: float | None = None  # None: no TTL
    last_used: float = 0.0
    embedding: np.ndarray | None = None  # [dim] float32, None when the entry is exact-only


class CacheStore(ABC):
    """Entries by id and by (scope, exact key), bounded by LRU, selectable by tenant and version."""

    max_entries: int

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def put(self, entry: Entry) -> list[str]:
        """Insert `entry`, replacing the one with the same scope and exact key; return every id displaced."""

    @abstractmethod
    def get(self, entry_id: str) -> Entry | None: ...

    @abstractmethod
    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None: ...

    @abstractmethod
    def touch(self, entry_id: str, now: float) -> None:
        """Mark an entry used (for LRU eviction)."""

    @abstractmethod
    def delete(self, entry_ids: Iterable[str]) -> list[str]:
        """Delete entries; return the ids that existed."""

    @abstractmethod
    def ids_of_tenant(self, tenant: str | None, limit: int | None = None) -> list[str]:
        """Ids of a tenant's entries (every entry with None)."""

    @abstractmethod
    def ids_not_at_data_version(self, tenant: str, data_version: str, created_before: float, limit: int) -> list[str]:
        """Ids of a tenant's entries created before a bump at another data version than the bumped one."""

    @abstractmethod
    def ids_of_model_version(self, model_version: str, limit: int) -> list[str]: ...

    @abstractmethod
    def expired(self, now: float, limit: int = 1000) -> list[str]: ...

    @abstractmethod
    def vectors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of every entry with an embedding."""

    @abstractmethod
    def close(self) -> None: ...

    def change_cursor(self) -> str:
        """Where the change log ends now; a store only one process writes has none."""
        return ""

    def changes_since(self, cursor: str, limit: int = 1000) -> tuple[str, list[tuple[str, str, str]]]:
        """(new cursor, [(op 'put' or 'del', entry id, partition)]) written after `cursor`, by any replica."""
        return cursor, []


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    entry_id TEXT PRIMARY KEY,
    scope_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    data_version TEXT NOT NULL,
    model_version TEXT NOT NULL,
    exact_key TEXT NOT NULL,
    partition TEXT NOT NULL,
    semantic_text TEXT NOT NULL,
    response TEXT NOT NULL,
    usage TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    last_used REAL NOT NULL,
    embedding BLOB
);
CREATE UNIQUE INDEX IF NOT EXISTS entries_exact ON entries (scope_id, exact_key);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries (tenant, data_version);
CREATE INDEX IF NOT EXISTS entries_expiry ON entries (expires_at) WHERE expires_at IS NOT NULL;
"""

_COLUMNS = ("entry_id, scope_id, tenant, data_version, model_version, exact_key, partition, semantic_text, "
            "response, usage, metadata, created_at, expires_at, last_used, embedding")


class SQLiteStore(CacheStore):
    """Entries in one SQLite file (or `:memory:`), at most `max_entries` of them, LRU-evicted. Thread-safe."""

    def __init__(self, path: str | Path = ":memory:", *, max_entries: int = 100_000):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._lock = threading.RLock()  # one connection, shared by threads
        try:
            if str(path) != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._count = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        except sqlite3.Error as exc:
            raise CacheStoreError(f"cannot open cache store {path}: {exc}") from exc

    def __len__(self) -> int:
        return self._count

    def _run(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self._db.execute(sql, tuple(args))
        except sqlite3.Error as exc:
            raise CacheStoreError(str(exc)) from exc

    def put(self, entry: Entry) -> list[str]:
        """Insert `entry` (replacing one with the same scope and exact key). Returns the ids it displaced:
        the replaced entry, and the least recently used ones evicted to stay within `max_entries`."""
        blob = None if entry.embedding is None else np.asarray(entry.embedding, dtype=np.float32).tobytes()
        row = (entry.entry_id, entry.scope_id, entry.tenant, entry.data_version, entry.model_version, entry.exact_key,
               entry.partition, entry.semantic_text, entry.response, json.dumps(entry.usage),
               json.dumps(entry.metadata), entry.created_at, entry.expires_at, entry.last_used, blob)
        with self._lock:
            replaced = [r[0] for r in self._run("SELECT entry_id FROM entries WHERE scope_id=? AND exact_key=?",
                                                (entry.scope_id, entry.exact_key))]
            self._run("BEGIN IMMEDIATE")
            try:
                if replaced:
                    self._run("DELETE FROM entries WHERE entry_id=?", replaced)
                self._run(f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES ({','.join('?' * 15)})", row)
                self._count += 1 - len(replaced)
                evicted: list[str] = []
                if self._count > self.max_entries:
                    evicted = [r[0] for r in self._run(
                        "SELECT entry_id FROM entries WHERE entry_id != ? ORDER BY last_used LIMIT ?",
                        (entry.entry_id, self._count - self.max_entries))]
                    self._delete_locked(evicted)
                self._run("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._count = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
                raise
        return replaced + evicted

    def get(self, entry_id: str) -> Entry | None:
        with self._lock:
            row = self._run(f"SELECT {_COLUMNS} FROM entries WHERE entry_id=?", (entry_id,)).fetchone()
        return _entry(row) if row else None

    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None:
        with self._lock:
            row = self._run(f"SELECT {_COLUMNS} FROM entries WHERE scope_id=? AND exact_key=?",
                            (scope_id, exact_key)).fetchone()
        return _entry(row) if row else None

    def touch(self, entry_id: str, now: float) -> None:
        """Mark an entry used (for LRU eviction)."""
        self._run("UPDATE entries SET last_used=? WHERE entry_id=?", (now, entry_id))

    def delete(self, entry_ids: Iterable[str]) -> list[str]:
        ids = list(entry_ids)
        with self._lock:
            return self._delete_locked(ids)

    def _delete_locked(self, ids: list[str]) -> list[str]:
        gone: list[str] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            gone += [r[0] for r in self._run(f"SELECT entry_id FROM entries WHERE entry_id IN ({marks})", chunk)]
            self._run(f"DELETE FROM entries WHERE entry_id IN ({marks})", chunk)
        self._count -= len(gone)
        return gone

    def _select_ids(self, where: str, args: Iterable[Any] = (), limit: int | None = None) -> list[str]:
        sql = f"SELECT entry_id FROM entries WHERE {where}" + (f" LIMIT {int(limit)}" if limit else "")
        with self._lock:
            return [r[0] for r in self._run(sql, args)]

    def ids_of_tenant(self, tenant: str | None, limit: int | None = None) -> list[str]:
        return self._select_ids("tenant = ?", (tenant,), limit) if tenant is not None else \
            self._select_ids("1", (), limit)

    def ids_not_at_data_version(self, tenant: str, data_version: str, created_before: float, limit: int) -> list[str]:
        return self._select_ids("tenant = ? AND data_version != ? AND created_at < ?",
                                (tenant, data_version, created_before), limit)

    def ids_of_model_version(self, model_version: str, limit: int) -> list[str]:
        return self._select_ids("model_version = ?", (model_version,), limit)

    def expired(self, now: float, limit: int = 1000) -> list[str]:
        return self._select_ids("expires_at IS NOT NULL AND expires_at <= ?", (now,), limit)

    def vectors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of every entry with an embedding: rebuilds the index after a restart."""
        rows = self._run("SELECT entry_id, partition, embedding FROM entries WHERE embedding IS NOT NULL "
                         "ORDER BY rowid").fetchall()
        for entry_id, partition, blob in rows:
            yield entry_id, partition, np.frombuffer(blob, dtype=np.float32)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _entry(row: tuple[Any, ...]) -> Entry:
    blob = row[14]
    return Entry(entry_id=row[0], scope_id=row[1], tenant=row[2], data_version=row[3], model_version=row[4],
                 exact_key=row[5], partition=row[6], semantic_text=row[7], response=row[8], usage=json.loads(row[9]),
                 metadata=json.loads(row[10]), created_at=row[11], expires_at=row[12], last_used=row[13],
                 embedding=None if blob is None else np.frombuffer(blob, dtype=np.float32))
