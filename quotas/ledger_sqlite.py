"""The usage ledger in SQLite (WAL) under the data directory: the embedded default (`Ledger(path)` opens it).

The writer, its group commits and its fault handling are quotas/ledger.py's, shared with the fleet's
PostgreSQL ledger (quotas/ledger_postgres.py). How durable a commit is here, is the `sync` setting: "normal"
(the default; WAL with synchronous=NORMAL) hands each commit to the operating system before the response
ends, which a killed gateway cannot undo, and syncs the disk at each checkpoint; "full" also waits for the
disk at every commit, so a power cut loses no row either, at the cost of an fsync per group (about 4 ms on
this project's machine, added to every answer).
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any, Literal

from quotas import ledger_identity, ledger_reads
from quotas.ledger import Ledger, Pending, Statement, log
from quotas.ledger_reads import EXACT, LedgerReads, Reader, ReadSource
from quotas.ledger_rows import (
    CARRY_PENDING,
    FALLBACK_PENDING,
    FALLBACK_SCHEMA,
    FOLD_OLD_REFUSALS,
    INSERT,
    SCHEMA,
    UPSERT_COUNT,
    CountKey,
    LedgerRow,
    Refusal,
    RequestTotals,
    count_key,
    to_db,
)
from quotas.write_turns import WriteTurns

# SQLite's primary result codes for faults of the database, not of the row: BUSY, LOCKED, NOMEM, READONLY,
# IOERR, CORRUPT, FULL, CANTOPEN, PROTOCOL, NOTADB
_NOT_THE_ROWS_FAULT = {5, 6, 7, 8, 10, 11, 13, 14, 15, 26}
CHECKPOINT_EVERY = 100  # group commits between the writer's checkpoints (SQLite's own: every 1,000 WAL pages)
_PARSED_MAX = 10_000  # distinct money texts kept parsed while summing (most rows repeat a few: free cache hits)


class SQLiteReads(LedgerReads):
    """SQLite's side of the reads: money is TEXT here, so request sums are taken where the rows are read, as
    exact decimals, a batch at a time (only the report's columns; no row object per request)."""

    _TS_SECOND = "(CAST(ts AS INTEGER) - (ts < CAST(ts AS INTEGER)))"

    def _day_start(self, second: str) -> str:
        return f"({second} - ((({second}) % 86400) + 86400) % 86400)"

    def _sum_requests(self, keys: list[str], where: str, args: tuple[Any, ...]) -> list[RequestTotals]:
        n = len(keys)
        sql = (f"SELECT {''.join(k + ', ' for k in keys)}input_tokens, output_tokens, cache_status, price_usd, "
               f"compute_cost_usd, cache_saving_usd, route_saving_usd FROM requests WHERE {where}")
        groups: dict[tuple[Any, ...], list[Any]] = {}
        parsed: dict[str, Decimal] = {}

        def exact(text: str) -> Decimal:
            value = parsed.get(text)
            if value is None:
                if len(parsed) >= _PARSED_MAX:
                    parsed.clear()
                value = parsed[text] = Decimal(text)
            return value

        zero = Decimal(0)
        with localcontext(EXACT):
            for batch in self._stream(sql, args, ledger_reads.READ_BATCH):
                for row in batch:
                    key = row[:n]
                    t = groups.get(key)
                    if t is None:
                        t = groups[key] = [0, 0, 0, 0, zero, zero, zero, zero, 0]
                    input_tokens, output_tokens, cache_status, price, cost, cache_saving, route_saving = row[n:]
                    route = exact(route_saving)
                    t[0] += 1
                    t[1] += input_tokens
                    t[2] += output_tokens
                    t[3] += cache_status == "hit"
                    t[4] += exact(price)
                    t[5] += exact(cost)
                    t[6] += exact(cache_saving)
                    t[7] += route
                    t[8] += route > 0
        return [RequestTotals(key, *t) for key, t in groups.items()]


class SQLiteLedger(SQLiteReads, Ledger):
    """The ledger in one SQLite file (`path`), read and written by this process and the CLI."""

    def __init__(self, path: Path, *, record_timeout_s: float = 10.0, busy_timeout_s: float = 5.0,
                 refusal_retention_days: float = 90.0, sync: Literal["normal", "full"] = "normal",
                 on_connect: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """`on_connect` runs on each new writer connection (tests use it to make the disk "full")."""
        super().__init__(record_timeout_s=record_timeout_s, busy_timeout_s=busy_timeout_s,
                         refusal_retention_days=refusal_retention_days)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if sync not in ("normal", "full"):
            raise ValueError(f"ledger sync is normal or full, not {sync!r}")
        self.sync = sync
        self._on_connect = on_connect
        self._turns = WriteTurns(path, wait_s=busy_timeout_s)  # turns with other processes' commits
        self._commits = 0  # by the writer, across its reconnects: every CHECKPOINT_EVERY, a checkpoint
        self._read = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        # queries run in worker threads (reports, the reapers' billing, /admin/ops), each thread on a connection of
        # its own: under WAL readers wait neither on each other nor on the writer, so a long report holds up nobody
        self._readers = threading.local()
        self._opened: list[sqlite3.Connection] = []
        self._opened_lock = threading.Lock()
        self._read.execute("PRAGMA journal_mode=WAL")
        self._read.executescript(SCHEMA)
        columns = {r[1] for r in self._read.execute("PRAGMA table_info(requests)")}
        for name, decl in (("degrade_level", "INTEGER NOT NULL DEFAULT 0"), ("degrade_actions", "TEXT"),
                           ("requested_tier", "TEXT"), ("route_saving_usd", "TEXT NOT NULL DEFAULT '0'"),
                           ("cache_status", "TEXT"), ("cache_saving_usd", "TEXT NOT NULL DEFAULT '0'"),
                           ("cascade_of", "TEXT"), ("model_version", "TEXT"), ("fallback", "TEXT")):
            if name not in columns:  # a ledger from before the degradation ladder
                self._read.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")
        self._read.executescript(FALLBACK_SCHEMA)
        if not _has_table(self._read, "fallback_pending"):  # new, or from before the list: its pending rows, once
            with _transaction(self._read):
                if not _has_table(self._read, "fallback_pending"):
                    for sql in FALLBACK_PENDING:
                        self._read.execute(sql)
                    self._read.execute(CARRY_PENDING)
        if _has_table(self._read, "refusals"):  # a ledger from before refusals were counted: fold its rows in, once
            with _transaction(self._read):
                if _has_table(self._read, "refusals"):
                    self._read.execute(FOLD_OLD_REFUSALS)
                    self._read.execute("DROP TABLE refusals")
        # which ledger this is (quotas/ledger_identity.py), made here and not on the first claim that asks: there it
        # took the write lock outside the write turns, and a long write behind it cost that request a 503
        ledger_identity.make_sqlite(self._read)

    def record_now(self, rows: list[LedgerRow], refusals: Iterable[Refusal] = ()) -> None:
        counts = Counter(count_key(r) for r in refusals)
        with _transaction(self._read):
            self._read.executemany(INSERT, [to_db(r) for r in rows])
            self._read.executemany(UPSERT_COUNT, [(*k, n) for k, n in counts.items()])

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self.busy_timeout_s)
        conn.execute(f"PRAGMA synchronous={self.sync.upper()}")
        # checkpoints in `_after_commit`, outside the write turn: SQLite's own ran inside COMMIT, and so inside the
        # turn, where another process's commit waited the whole checkpoint (p99.9 12-14 ms against 0.2-0.3 ms,
        # bench/sqlite_writers.py)
        conn.execute("PRAGMA wal_autocheckpoint=0")
        if self._on_connect is not None:
            self._on_connect(conn)
        return conn

    def _commit(self, conn: sqlite3.Connection, rows: list[Pending], counts: Counter[CountKey], *,
                prune: bool, isolate: bool) -> list[Exception | None]:
        with self._turns.turn(), _transaction(conn):
            if isolate:
                errors = [_isolated(conn, ((INSERT, values), *with_row)) for values, _, with_row in rows]
                for key, n in counts.items():
                    if (error := _isolated(conn, ((UPSERT_COUNT, (*key, n)),))) is not None:
                        log.error("ledger: refusal count %s dropped: %r", key, error)
            else:
                conn.executemany(INSERT, [values for values, _, _ in rows])
                for _, _, with_row in rows:
                    for sql, params in with_row:
                        conn.execute(sql, params)
                conn.executemany(UPSERT_COUNT, [(*key, n) for key, n in counts.items()])
                errors = [None] * len(rows)
            if prune:
                conn.execute("DELETE FROM refusal_counts WHERE minute < ?", (self._prune_before(),))
        return errors

    def _after_commit(self, conn: sqlite3.Connection) -> None:
        """Every CHECKPOINT_EVERY commits, a passive checkpoint (it waits for no reader or writer), after the
        group's waiters have heard and outside the write turn. WAL mode syncs the disk at a checkpoint."""
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY:
            return
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:  # the next one tries again; the rows are committed either way
            log.warning("ledger: checkpoint failed: %s", exc)

    def _is_db_fault(self, exc: BaseException) -> bool:
        return _not_the_rows_fault(exc)

    def _fault_name(self, exc: BaseException) -> str:
        return getattr(exc, "sqlite_errorname", type(exc).__name__)

    def mark_fallback_applied(self, request_ids: Sequence[str]) -> None:
        """Noted in `fallback_applied`, whose trigger takes them off `fallback_pending` in the same commit."""
        conn = self._reader()  # this thread's: the writer's commits wait for nothing of it but this short one
        with _transaction(conn):
            conn.executemany("INSERT OR IGNORE INTO fallback_applied VALUES (?)", [(rid,) for rid in request_ids])

    def read_source(self) -> ReadSource:
        return ReadSource("sqlite", str(self.path.resolve()))

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return self._reader().execute(sql, args).fetchall()

    def _stream(self, sql: str, args: tuple[Any, ...], size: int) -> Iterator[list[tuple[Any, ...]]]:
        yield from _batches(self._reader(), sql, args, size)  # the connection of the thread that reads

    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._readers, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0, check_same_thread=False)
            self._readers.conn = conn
            with self._opened_lock:
                self._opened.append(conn)
        return conn

    def _close_reads(self) -> None:
        with self._opened_lock:
            opened, self._opened = self._opened, []
        for conn in (*opened, self._read):
            conn.close()
        self._turns.close()


class SQLiteReader(SQLiteReads, Reader):
    """A read-only connection to a ledger's SQLite file (one that exists: it is never created here)."""

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=rw", uri=True, isolation_level=None,
                                     timeout=5.0, check_same_thread=False)
        self._conn.execute("PRAGMA query_only = ON")

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, args).fetchall()

    def _stream(self, sql: str, args: tuple[Any, ...], size: int) -> Iterator[list[tuple[Any, ...]]]:
        return _batches(self._conn, sql, args, size)

    def close(self) -> None:
        self._conn.close()


def _batches(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...], size: int) -> Iterator[list[tuple[Any, ...]]]:
    cursor = conn.execute(sql, args)
    try:
        while batch := cursor.fetchmany(size):
            yield batch
    finally:
        cursor.close()


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE … COMMIT on an autocommit connection, ROLLBACK on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def _isolated(conn: sqlite3.Connection, statements: tuple[Statement, ...]) -> Exception | None:
    """Run statements in a savepoint: their own error undoes only them; a fault of the database propagates."""
    conn.execute("SAVEPOINT one")
    try:
        for sql, values in statements:
            conn.execute(sql, values)
    except Exception as exc:
        if _not_the_rows_fault(exc):
            raise
        conn.execute("ROLLBACK TO one")
        conn.execute("RELEASE one")
        return exc
    conn.execute("RELEASE one")
    return None


def _not_the_rows_fault(exc: BaseException) -> bool:
    """A fault of the database or its disk (retry later), not one the row's values caused (refuse the row)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) or (code is not None and code & 0xFF in _NOT_THE_ROWS_FAULT)
