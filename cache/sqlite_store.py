"""`SQLiteStore`: cache entries in one SQLite file (or `:memory:`), the embedded `CacheStore` (cache/store.py).

Every process that opens the same SQLite file (gateway workers, the CLI) writes through triggers that keep the
per-tenant counts and a change log (`changes_since`), which each process's faiss index follows, as with Redis.
SQLite runs in WAL mode with `synchronous=NORMAL`: a crash may lose the last few cache writes, which only
costs a later miss, never a wrong answer.

Reads never wait for writes, so one tenant's stores (each a transaction that may evict) never stall another
tenant's lookups: a file store writes through one connection under `_lock` and reads through a small pool of
other connections, which WAL lets read the last committed state while a write transaction is open, in this
process or another. A write is visible to every read that starts after its commit (read your own writes). A
lookup's one write, `touch` (an LRU mark), does not wait either: while a write is in progress the mark is kept and
written by the next write (a `put` writes the marks before it evicts by them). `:memory:` has one connection, so
its reads still take `_lock`: tests and benchmarks only.

SQLite's own checkpoints are off (`wal_autocheckpoint=0` on every connection): SQLite ran one inside whichever
COMMIT took the WAL past 1,000 pages, a lookup's `touch` as often as a put, and that lookup waited out the copy of
the WAL into the database file and its sync. The store counts the rows it writes instead, and
past `checkpoint_every` `checkpoint_due` says so; the cache's writer thread then runs `checkpoint`, a passive
one (it waits for no reader), and starts the WAL over, so the WAL stays about as small as SQLite kept it (a put
writes about 12 pages) and no lookup ever pays for it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from cache.store import MAX_BYTES_PER_TENANT, CacheStore, CacheStoreError, Entry, check_bounds, stored_bytes

_SCHEMA = """
BEGIN IMMEDIATE;
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
    embedding BLOB,
    size INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS entries_exact ON entries (scope_id, exact_key);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_tenant ON entries (tenant, data_version);
CREATE INDEX IF NOT EXISTS entries_tenant_lru ON entries (tenant, last_used);
CREATE INDEX IF NOT EXISTS entries_expiry ON entries (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op TEXT NOT NULL,
    entry_id TEXT NOT NULL,
    partition TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tenant_sizes (tenant TEXT PRIMARY KEY, n INTEGER NOT NULL, bytes INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS data_bumps (tenant TEXT PRIMARY KEY, version TEXT NOT NULL, bumped_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS entry_count (id INTEGER PRIMARY KEY CHECK (id = 0), n INTEGER NOT NULL);
INSERT INTO tenant_sizes (tenant, n, bytes) SELECT tenant, COUNT(*), SUM(size) FROM entries
    WHERE NOT EXISTS (SELECT 1 FROM entry_count) GROUP BY tenant;
INSERT OR IGNORE INTO entry_count (id, n) SELECT 0, COUNT(*) FROM entries;
"""
# What keeps each tenant's size and the change log: one statement each (`_add_sizes` runs them one by one too)
_TRIGGERS = ("""CREATE TRIGGER IF NOT EXISTS entries_put AFTER INSERT ON entries BEGIN
    INSERT INTO tenant_sizes (tenant, n, bytes) VALUES (NEW.tenant, 1, NEW.size)
        ON CONFLICT (tenant) DO UPDATE SET n = n + 1, bytes = bytes + NEW.size;
    UPDATE entry_count SET n = n + 1;
    INSERT INTO changes (op, entry_id, partition) SELECT 'put', NEW.entry_id, NEW.partition
        WHERE NEW.embedding IS NOT NULL;
END""", """CREATE TRIGGER IF NOT EXISTS entries_del AFTER DELETE ON entries BEGIN
    UPDATE tenant_sizes SET n = n - 1, bytes = bytes - OLD.size WHERE tenant = OLD.tenant;
    UPDATE entry_count SET n = n - 1;
    INSERT INTO changes (op, entry_id, partition) VALUES ('del', OLD.entry_id, OLD.partition);
END""")
_SCHEMA += "".join(f"{trigger};\n" for trigger in _TRIGGERS) + "COMMIT;\n"

# Files written before the byte budget: each row's size (`stored_bytes`, counted in SQL) and each tenant's total, once;
# their triggers are replaced by the schema's, which count sizes too, in the same transaction (dropped alone, until
# `_SCHEMA` made them again, a write by another process, a gateway of before still running, counted nothing).
_TEXT_COLUMNS = ("entry_id", "scope_id", "tenant", "data_version", "model_version", "exact_key", "partition",
                 "semantic_text", "response", "usage", "metadata")
_SIZE_SQL = " + ".join([f"length(CAST({c} AS BLOB))" for c in _TEXT_COLUMNS] + ["COALESCE(length(embedding), 0)"])
_ADD_SIZES = f"""
ALTER TABLE entries ADD COLUMN size INTEGER NOT NULL DEFAULT 0;
UPDATE entries SET size = {_SIZE_SQL};
DROP TRIGGER IF EXISTS entries_put;
DROP TRIGGER IF EXISTS entries_del;
"""
_ADD_TENANT_BYTES = """
ALTER TABLE tenant_sizes ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
UPDATE tenant_sizes SET bytes = (SELECT COALESCE(SUM(size), 0) FROM entries WHERE entries.tenant = tenant_sizes.tenant);
"""

_COLUMNS = ("entry_id, scope_id, tenant, data_version, model_version, exact_key, partition, semantic_text, "
            "response, usage, metadata, created_at, expires_at, last_used, embedding")
MAX_CHANGES = 100_000  # change-log rows kept; a process further behind reloads its index (a 'reset')
IDLE_READERS = 8  # read connections kept open between reads; more are opened while more threads read at once
BUSY_TIMEOUT_MS = 5000  # how long a statement waits for another process's write lock
# Rows written (put, touched, deleted) between checkpoints: ~1,200 WAL pages at ~12 a put (SQLite's own: 1,000).
CHECKPOINT_EVERY = 100


class SQLiteStore(CacheStore):
    """Entries in one SQLite file (or `:memory:`), at most `max_entries` of them, and `max_entries_per_tenant` and
    `max_bytes_per_tenant` (`stored_bytes`) of one tenant's (None: no bound of its own), LRU-evicted. Thread-safe;
    several processes may share the file. Writes go through one connection under `_lock`; reads (of a file) through
    idle read connections, without it."""

    def __init__(self, path: str | Path = ":memory:", *, max_entries: int = 100_000,
                 max_entries_per_tenant: int | None = None, max_bytes_per_tenant: int | None = MAX_BYTES_PER_TENANT,
                 checkpoint_every: int = CHECKPOINT_EVERY):
        check_bounds(max_entries, max_entries_per_tenant, max_bytes_per_tenant)
        self.max_entries = max_entries
        self.max_entries_per_tenant = max_entries_per_tenant or max_entries
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._path = str(path)
        self._memory = self._path == ":memory:"  # one connection: its reads take _lock too
        self._lock = threading.RLock()  # the write connection, shared by threads
        self._idle: list[sqlite3.Connection] = []  # read connections not in use (a file store's)
        self._idle_lock = threading.Lock()
        self._closed = False
        self._marks: dict[str, float] = {}  # LRU marks not yet written (touched while a write was in progress)
        self._marks_lock = threading.Lock()
        self._num_puts = 0
        self.checkpoint_every = checkpoint_every
        self._written = 0  # rows written since the last checkpoint (approximate: counted without a lock)
        try:
            if not self._memory:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = self._connect()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._add_sizes()
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise CacheStoreError(f"cannot open cache store {path}: {exc}") from exc

    def __len__(self) -> int:
        return int(self._read_one("SELECT n FROM entry_count") or 0)

    def _add_sizes(self) -> None:
        """Count sizes in a file written before the byte budget (`_ADD_SIZES`), in one transaction."""
        def columns(table: str) -> set[str]:
            return {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}

        if "size" in columns("entries") or not columns("entries"):
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if "size" not in columns("entries"):  # not added meanwhile by another process
                for statement in filter(str.strip, _ADD_SIZES.split(";")):
                    self._db.execute(statement)
                if columns("tenant_sizes") and "bytes" not in columns("tenant_sizes"):
                    for statement in filter(str.strip, _ADD_TENANT_BYTES.split(";")):
                        self._db.execute(statement)
                if all(columns(table) for table in ("tenant_sizes", "entry_count", "changes")):
                    for trigger in _TRIGGERS:  # what they count exists: counted from this commit on
                        self._db.execute(trigger)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        db.execute("PRAGMA wal_autocheckpoint=0")  # `checkpoint` instead, in the writer thread: see the module
        return db

    # -- the write connection (under _lock) -------------------------------------------------------------

    def _run(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self._db.execute(sql, tuple(args))
        except sqlite3.Error as exc:
            raise CacheStoreError(str(exc)) from exc

    def _one(self, sql: str, args: Iterable[Any] = ()) -> Any:
        with self._lock:
            row = self._run(sql, args).fetchone()
        return row[0] if row else None

    # -- reads (never under _lock, except :memory:'s) ---------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """A connection to read with: an idle read connection (or a new one), or `:memory:`'s only one."""
        if self._memory:
            with self._lock:
                yield self._db
            return
        with self._idle_lock:
            if self._closed:
                raise CacheStoreError("cache store closed")
            db = self._idle.pop() if self._idle else None
        try:
            if db is None:
                db = self._connect()
                db.execute("PRAGMA query_only=1")
        except sqlite3.Error as exc:
            raise CacheStoreError(f"cannot open cache store {self._path}: {exc}") from exc
        try:
            yield db
        finally:
            with self._idle_lock:
                keep = not self._closed and len(self._idle) < IDLE_READERS
                if keep:
                    self._idle.append(db)
            if not keep:
                db.close()

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[Any]:
        """Every row of a query, read in one statement of its own: what was committed when it started."""
        try:
            with self._reading() as db:
                return db.execute(sql, tuple(args)).fetchall()
        except sqlite3.Error as exc:
            raise CacheStoreError(str(exc)) from exc

    def _read_one(self, sql: str, args: Iterable[Any] = ()) -> Any:
        rows = self._read(sql, args)
        return rows[0][0] if rows else None

    def put(self, entry: Entry) -> list[str] | None:
        """Insert `entry` (replacing one with the same scope and exact key). Returns the ids it displaced:
        the replaced entry, and those evicted to stay within the tenant's bounds and the store's; None when its
        tenant's data was bumped past it, or it alone is larger than its tenant's byte budget (`CacheStore.put`)."""
        size = stored_bytes(entry)
        if self.max_bytes_per_tenant is not None and size > self.max_bytes_per_tenant:
            return None  # larger than its tenant's whole budget: it would evict everything else and still be over
        blob = None if entry.embedding is None else np.asarray(entry.embedding, dtype=np.float32).tobytes()
        row = (entry.entry_id, entry.scope_id, entry.tenant, entry.data_version, entry.model_version, entry.exact_key,
               entry.partition, entry.semantic_text, entry.response, json.dumps(entry.usage),
               json.dumps(entry.metadata), entry.created_at, entry.expires_at, entry.last_used, blob, size)
        with self._lock:
            self._run("BEGIN IMMEDIATE")
            try:
                self._write_marks_locked()  # before evicting by them
                if self._one("SELECT 1 FROM data_bumps WHERE tenant=? AND version != ? AND bumped_at > ?",
                             (entry.tenant, entry.data_version, entry.created_at)):
                    self._run("COMMIT")  # the marks only
                    return None
                replaced = [r[0] for r in self._run(
                    "SELECT entry_id FROM entries WHERE (scope_id=? AND exact_key=?) OR entry_id=?",
                    (entry.scope_id, entry.exact_key, entry.entry_id))]
                self._delete_locked(replaced)
                self._run(f"INSERT INTO entries ({_COLUMNS}, size) VALUES ({','.join('?' * 16)})", row)
                evicted = self._evict_locked(entry)
                self._num_puts += 1
                if self._num_puts % 1024 == 0:
                    self._run("DELETE FROM changes WHERE seq <= (SELECT MAX(seq) FROM changes) - ?", (MAX_CHANGES,))
                self._write_marks_locked()  # and those kept while it ran
                self._run("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._written += 1 + len(replaced) + len(evicted)
        return [r for r in replaced if r != entry.entry_id] + evicted

    def _evict_locked(self, entry: Entry) -> list[str]:
        """The tenant's own least recently used beyond its bounds (count, then bytes), then, beyond the store's,
        the least recently used of whichever tenant holds the most."""
        evicted: list[str] = []
        over = (self._one("SELECT n FROM tenant_sizes WHERE tenant=?", (entry.tenant,)) or 0) \
            - self.max_entries_per_tenant
        if over > 0:
            evicted += self._delete_locked([r[0] for r in self._run(
                "SELECT entry_id FROM entries WHERE tenant=? AND entry_id != ? ORDER BY last_used LIMIT ?",
                (entry.tenant, entry.entry_id, over))])
        if self.max_bytes_per_tenant is not None:
            over = (self._one("SELECT bytes FROM tenant_sizes WHERE tenant=?", (entry.tenant,)) or 0) \
                - self.max_bytes_per_tenant
            if over > 0:
                evicted += self._delete_locked(self._oldest_holding(entry, over))
        while (over := (self._one("SELECT n FROM entry_count") or 0) - self.max_entries) > 0:
            largest = self._one("SELECT tenant FROM tenant_sizes ORDER BY n DESC LIMIT 1")
            victims = [r[0] for r in self._run(
                "SELECT entry_id FROM entries WHERE tenant=? AND entry_id != ? ORDER BY last_used LIMIT ?",
                (largest, entry.entry_id, over))]
            if not victims:  # only the new entry is left in the largest tenant: take the oldest of anyone's
                victims = [r[0] for r in self._run(
                    "SELECT entry_id FROM entries WHERE entry_id != ? ORDER BY last_used LIMIT ?",
                    (entry.entry_id, over))]
            gone = self._delete_locked(victims)
            evicted += gone
            if not gone:
                break
        return evicted

    def _oldest_holding(self, entry: Entry, num_bytes: int) -> list[str]:
        """The tenant's least recently used entries (never `entry`) that together hold at least `num_bytes`."""
        cursor = self._run("SELECT entry_id, size FROM entries WHERE tenant=? AND entry_id != ? ORDER BY last_used",
                           (entry.tenant, entry.entry_id))
        ids: list[str] = []
        try:
            while num_bytes > 0 and (rows := cursor.fetchmany(64)):
                for entry_id, size in rows:
                    ids.append(entry_id)
                    num_bytes -= size
                    if num_bytes <= 0:
                        break
        finally:
            cursor.close()
        return ids

    def get(self, entry_id: str) -> Entry | None:
        rows = self._read(f"SELECT {_COLUMNS} FROM entries WHERE entry_id=?", (entry_id,))
        return _entry(rows[0]) if rows else None

    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None:
        rows = self._read(f"SELECT {_COLUMNS} FROM entries WHERE scope_id=? AND exact_key=?", (scope_id, exact_key))
        return _entry(rows[0]) if rows else None

    def touch(self, entry_id: str, now: float) -> None:
        """Mark an entry used (for LRU eviction). Never waits for a write in progress, in this process or
        another: the mark is then kept, and written by the next write."""
        with self._marks_lock:
            self._marks[entry_id] = now
        if not self._lock.acquire(blocking=False):
            return  # the write in progress (a put) or the next one writes it
        try:
            self._db.execute("PRAGMA busy_timeout=0")
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY:
                    raise
                return  # another process is writing the file: the next write writes the mark
            finally:
                self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            try:
                self._write_marks_locked()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise CacheStoreError(str(exc)) from exc
        finally:
            self._lock.release()

    def _write_marks_locked(self) -> None:
        """Write the LRU marks kept by `touch` (in the caller's transaction)."""
        with self._marks_lock:
            marks, self._marks = self._marks, {}
        if marks:
            try:
                self._db.executemany("UPDATE entries SET last_used=? WHERE entry_id=?",
                                     [(used, entry_id) for entry_id, used in marks.items()])
            except sqlite3.Error as exc:
                raise CacheStoreError(str(exc)) from exc
            self._written += len(marks)

    def delete(self, entry_ids: Iterable[str]) -> list[str]:
        ids = list(entry_ids)
        with self._lock:
            return self._delete_locked(ids)

    def _delete_locked(self, ids: list[str]) -> list[str]:
        gone: list[str] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            gone += [r[0] for r in self._run(f"DELETE FROM entries WHERE entry_id IN ({marks}) RETURNING entry_id",
                                             chunk).fetchall()]
        self._written += len(gone)
        return gone

    def _select_ids(self, where: str, args: Iterable[Any] = (), limit: int | None = None) -> list[str]:
        sql = f"SELECT entry_id FROM entries WHERE {where}" + (f" LIMIT {int(limit)}" if limit else "")
        return [r[0] for r in self._read(sql, args)]

    def ids_of_tenant(self, tenant: str | None, limit: int | None = None) -> list[str]:
        return self._select_ids("tenant = ?", (tenant,), limit) if tenant is not None else \
            self._select_ids("1", (), limit)

    def ids_not_at_data_version(self, tenant: str, data_version: str, created_before: float, limit: int) -> list[str]:
        return self._select_ids("tenant = ? AND data_version != ? AND created_at < ?",
                                (tenant, data_version, created_before), limit)

    def ids_of_model_version(self, model_version: str, limit: int) -> list[str]:
        return self._select_ids("model_version = ?", (model_version,), limit)

    def model_versions(self) -> set[str]:
        return {row[0] for row in self._read("SELECT DISTINCT model_version FROM entries")}

    def drop_data_versions(self, tenant: str, current: str, created_before: float, batch: int = 500) -> list[str]:
        """One statement over the tenant's index range (the batched default rescans it for every batch), in the
        transaction that records the bump for `put`."""
        with self._lock:
            self._run("BEGIN IMMEDIATE")
            try:
                self._run("INSERT INTO data_bumps (tenant, version, bumped_at) VALUES (?, ?, ?) ON CONFLICT (tenant) "
                          "DO UPDATE SET version = excluded.version, bumped_at = excluded.bumped_at "
                          "WHERE excluded.bumped_at >= data_bumps.bumped_at", (tenant, current, created_before))
                gone = [r[0] for r in self._run(
                    "DELETE FROM entries WHERE tenant = ? AND data_version != ? AND created_at < ? RETURNING entry_id",
                    (tenant, current, created_before)).fetchall()]
                self._run("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._written += len(gone) + 1
            return gone

    def expired(self, now: float, limit: int = 1000) -> list[str]:
        return self._select_ids("expires_at IS NOT NULL AND expires_at <= ?", (now,), limit)

    def vectors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of every entry with an embedding: rebuilds the index after a restart."""
        rows = self._read("SELECT entry_id, partition, embedding FROM entries WHERE embedding IS NOT NULL "
                          "ORDER BY rowid")
        for entry_id, partition, blob in rows:
            yield entry_id, partition, np.frombuffer(blob, dtype=np.float32)

    def checkpoint_due(self) -> bool:
        return not self._memory and self._written >= self.checkpoint_every

    def checkpoint(self) -> None:
        """A passive checkpoint (it waits for no reader, nor another process's writer), then, if it copied the
        whole WAL, a small write that starts the WAL over from its beginning.

        Under `_lock`: no commit of this process lands meanwhile, so the checkpoint can finish the WAL (a commit
        during it leaves a tail the next one must copy; a WAL is reused from its start only once all of it is
        copied, so under a steady stream of lookups' marks it grew without bound). A `touch` meanwhile keeps its
        mark for later, as during a put. The new WAL's first commit syncs its header: done here too, not in the
        next commit, which may be a lookup's `touch`."""
        with self._lock:
            if self._memory or self._closed:
                return
            self._written = 0
            try:
                busy, frames, copied = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if busy or frames <= 0 or copied < frames:
                    return  # a reader or another process held part of it: the next checkpoint copies the rest
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._write_marks_locked()
                    self._db.execute("UPDATE entry_count SET n = n")  # one page: the new WAL's first frame
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise CacheStoreError(f"checkpoint of {self._path} failed: {exc}") from exc

    def change_cursor(self) -> str:
        return str(self._read_one("SELECT MAX(seq) FROM changes") or 0)

    def changes_since(self, cursor: str, limit: int = 1000) -> tuple[str, list[tuple[str, str, str]]]:
        after = int(cursor or 0)
        rows = self._read("SELECT seq, op, entry_id, partition FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
                          (after, limit))
        if not rows:
            return cursor, []
        if rows[0][0] > after + 1:
            low, high = self._read("SELECT MIN(seq), MAX(seq) FROM changes")[0]
            if low > after + 1:
                return str(high), [("reset", "", "")]  # trimmed past `after`
        return str(rows[-1][0]), [(op, entry_id, partition) for _, op, entry_id, partition in rows]

    def close(self) -> None:
        with self._lock:
            if self._marks:
                try:
                    self._run("BEGIN IMMEDIATE")
                    self._write_marks_locked()
                    self._run("COMMIT")
                except CacheStoreError:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
            self._db.close()
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for db in idle:
            db.close()



def _entry(row: tuple[Any, ...]) -> Entry:
    blob = row[14]
    return Entry(entry_id=row[0], scope_id=row[1], tenant=row[2], data_version=row[3], model_version=row[4],
                 exact_key=row[5], partition=row[6], semantic_text=row[7], response=row[8], usage=json.loads(row[9]),
                 metadata=json.loads(row[10]), created_at=row[11], expires_at=row[12], last_used=row[13],
                 embedding=None if blob is None else np.frombuffer(blob, dtype=np.float32))
