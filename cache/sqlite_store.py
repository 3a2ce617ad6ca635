"""`SQLiteStore`: cache entries in one SQLite file (or `:memory:`), the embedded `CacheStore` (cache/store.py).

Every process that opens the same SQLite file (gateway workers, the CLI) writes through triggers that keep the
per-tenant counts and a change log (`changes_since`), which each process's faiss index follows, as with Redis
(the tables and triggers, and the measuring of a file from before the byte budget: cache/sqlite_schema.py).
SQLite runs in WAL mode with `synchronous=NORMAL`: a crash may lose the last few cache writes, which only
costs a later miss, never a wrong answer.

Reads never wait for writes, so one tenant's stores (each a transaction that may evict) never stall another
tenant's lookups: a file store writes through one connection under `_lock` and reads through a small pool of
other connections (`Readers`, cache/sqlite_readers.py), which WAL lets read the last committed state while a write
transaction is open, in this process or another. A write is visible to every read that starts after its commit
(read your own writes). A lookup's one write, `touch` (an LRU mark), does not wait either: while a write is in
progress the mark is kept and written by the next write (a `put` writes the marks before it evicts by them).
`:memory:` has one connection, so its reads still take `_lock`: tests and benchmarks only.

SQLite's own checkpoints are off (`wal_autocheckpoint=0` on every connection): SQLite ran one inside whichever
COMMIT took the WAL past 1,000 pages, a lookup's `touch` as often as a put, and that lookup waited out the copy of
the WAL into the database file and its sync. The store counts the rows it writes instead, and
past `checkpoint_every` `checkpoint_due` says so; the cache's writer thread then runs `checkpoint`, a passive
one (it waits for no reader), and starts the WAL over, so the WAL stays about as small as SQLite kept it (a put
writes about 12 pages) and no lookup ever pays for it.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from cache.sqlite_readers import Readers
from cache.sqlite_schema import COLUMNS, SCHEMA, add_sizes, entry_of, entry_row
from cache.store import MAX_BYTES_PER_TENANT, CacheStore, CacheStoreError, Entry, check_bounds, stored_bytes

MAX_CHANGES = 100_000  # change-log rows kept; a process further behind reloads its index (a 'reset')
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
        self._readers = Readers(self._path, _connect)  # a file store's read connections
        self._marks: dict[str, float] = {}  # LRU marks not yet written (touched while a write was in progress)
        self._marks_lock = threading.Lock()
        self._num_puts = 0
        self.checkpoint_every = checkpoint_every
        self._written = 0  # rows written since the last checkpoint (approximate: counted without a lock)
        try:
            if not self._memory:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = _connect(self._path)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._add_sizes()
            self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise CacheStoreError(f"cannot open cache store {path}: {exc}") from exc

    def __len__(self) -> int:
        return int(self._read_one("SELECT n FROM entry_count") or 0)

    def _add_sizes(self) -> None:
        """Count sizes in a file written before the byte budget (cache/sqlite_schema.py), in one transaction."""
        add_sizes(self._db)

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
        with self._readers.connection() as db:
            yield db

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
        row = entry_row(entry, size)
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
                self._run(f"INSERT INTO entries ({COLUMNS}, size) VALUES ({','.join('?' * 16)})", row)
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
        rows = self._read(f"SELECT {COLUMNS} FROM entries WHERE entry_id=?", (entry_id,))
        return entry_of(rows[0]) if rows else None

    def find_exact(self, scope_id: str, exact_key: str) -> Entry | None:
        rows = self._read(f"SELECT {COLUMNS} FROM entries WHERE scope_id=? AND exact_key=?", (scope_id, exact_key))
        return entry_of(rows[0]) if rows else None

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

    def vectors_of(self, entry_ids: Iterable[str]) -> list[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of those of `entry_ids` stored with an embedding, in their order: what
        another process's write adds to this one's index (cache/entry_writes.py), one SELECT per 500 ids, and
        none of the entries' texts."""
        ids = list(entry_ids)
        found: dict[str, tuple[str, str, np.ndarray]] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            rows = self._read(f"SELECT entry_id, partition, embedding FROM entries WHERE entry_id IN "
                              f"({','.join('?' * len(chunk))}) AND embedding IS NOT NULL", chunk)
            found.update((i, (i, p, np.frombuffer(blob, dtype=np.float32))) for i, p, blob in rows)
        return [found[i] for i in dict.fromkeys(ids) if i in found]

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
            if self._memory or self._readers.closed:
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
        self._readers.close()


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    db.execute("PRAGMA wal_autocheckpoint=0")  # `checkpoint` instead, in the writer thread: see the module
    return db
