"""The usage ledger: one durable row per finished request, in SQLite (WAL) under the data directory.

One thread writes rows in grouped transactions (one fsync for many requests); `record` returns only once its
row is on disk, so a response the client received is never missing, even if the gateway is killed right after.
The writer never dies and drops no row it could still write: a row SQLite refuses (a duplicate id, a value
it cannot hold) fails only its own future, as a failed group is retried row by row; a fault of the database
(disk full, locked past the busy timeout, I/O error, read-only) keeps every pending row and makes the ledger
not ready until a retry, with backoff, commits, so the gateway refuses new work rather than serve unbilled.
Refusals are counted per minute, tenant, key, reason and status, not stored one by one, with a retention.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from quotas.ledger_rows import (
    COLUMNS,
    COUNT_COLUMNS,
    FOLD_OLD_REFUSALS,
    INSERT,
    SCHEMA,
    UPSERT_COUNT,
    CountKey,
    LedgerRow,
    Refusal,
    RefusalCount,
    count_key,
    from_db,
    to_db,
)

log = logging.getLogger("tiergate.ledger")
_Pending = tuple[tuple[Any, ...], asyncio.Future[None] | None]  # a row's values and who waits on it
_WAKE, _STOP = "wake", "stop"

GROUP_MAX = 512  # rows taken from the queue per commit at most
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0  # between retries while the ledger cannot commit
PRUNE_EVERY_S = 3600.0  # refusal counts past their retention are deleted at most this often
# SQLite's primary result codes for faults of the database, not of the row: BUSY, LOCKED, NOMEM, READONLY,
# IOERR, CORRUPT, FULL, CANTOPEN, PROTOCOL, NOTADB
_NOT_THE_ROWS_FAULT = {5, 6, 7, 8, 10, 11, 13, 14, 15, 26}


class LedgerUnavailable(Exception):
    """The ledger could not make a row durable in time (disk full, database locked, I/O error)."""


class Ledger:
    """`record` rows and `submit_refusal`s from the event loop; read back with `rows` and `refusal_counts`.
    `ready` is False while the writer cannot commit (or is not running); `not_ready_reason` says why."""

    def __init__(self, path: Path, *, record_timeout_s: float = 10.0, busy_timeout_s: float = 5.0,
                 refusal_retention_days: float = 90.0,
                 on_connect: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """`on_connect` runs on each new writer connection (tests use it to make the disk "full")."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.record_timeout_s = record_timeout_s
        self.busy_timeout_s = busy_timeout_s
        self.refusal_retention_days = refusal_retention_days
        self._on_connect = on_connect
        self._read = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        self._read.execute("PRAGMA journal_mode=WAL")
        self._read.executescript(SCHEMA)
        columns = {r[1] for r in self._read.execute("PRAGMA table_info(requests)")}
        for name, decl in (("degrade_level", "INTEGER NOT NULL DEFAULT 0"), ("degrade_actions", "TEXT"),
                           ("requested_tier", "TEXT"), ("route_saving_usd", "TEXT NOT NULL DEFAULT '0'"),
                           ("cache_status", "TEXT"), ("cache_saving_usd", "TEXT NOT NULL DEFAULT '0'"),
                           ("cascade_of", "TEXT")):
            if name not in columns:  # a ledger from before the degradation ladder
                self._read.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")
        if _has_old_refusals(self._read):  # a ledger from before refusals were counted: fold its rows in, once
            with _transaction(self._read):
                if _has_old_refusals(self._read):
                    self._read.execute(FOLD_OLD_REFUSALS)
                    self._read.execute("DROP TABLE refusals")
        self._queue: queue.Queue[_Pending | str] = queue.Queue()
        self._refusals: Counter[CountKey] = Counter()  # counted since the writer last took them
        self._refusals_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fault: str | None = None  # why the last commit failed, until one succeeds
        self._next_prune = 0.0

    @property
    def not_ready_reason(self) -> str | None:
        if self._thread is None or not self._thread.is_alive():
            return "the ledger writer is not running"
        return self._fault

    @property
    def ready(self) -> bool:
        return self.not_ready_reason is None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._writer, name="ledger-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write what is queued (giving up after `record_timeout_s` if the ledger cannot commit), then stop."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=self.record_timeout_s + self.busy_timeout_s + 5)
            self._thread = None
        self._read.close()

    async def record(self, row: LedgerRow, *, timeout_s: float | None = None) -> None:
        """Write `row`; returns once it is durable (see `wait_durable` for the errors)."""
        await self.wait_durable(self.submit(row), timeout_s=timeout_s)

    async def wait_durable(self, written: asyncio.Future[None], *, timeout_s: float | None = None) -> None:
        """Wait for a row `submit` queued; returns once it is durable.

        Raises `LedgerUnavailable` when it is not durable within `timeout_s` (default: `record_timeout_s`);
        the row stays queued and is written once the ledger can commit again. Raises the row's own error when
        SQLite refuses it (a duplicate request id, a value it cannot hold). Cancelling the caller never
        cancels the row.
        """
        timeout_s = self.record_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        # one waiter woken by the row or by a timer: costs what `shield` alone did (asyncio.timeout on top of
        # it added about 15 µs a call here)
        waiter: asyncio.Future[None] = loop.create_future()
        written.add_done_callback(lambda _: _wake(waiter))
        timer = loop.call_later(timeout_s, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
        if not written.done():
            why = self.not_ready_reason or "the ledger writer is behind"
            raise LedgerUnavailable(f"a usage row was not durable after {timeout_s:g} s: {why}")
        written.result()  # the row's own error, if SQLite refused it

    def submit(self, row: LedgerRow) -> asyncio.Future[None]:
        """Queue `row` for the next group commit; the future resolves once it is durable (`wait_durable`).

        Queuing is synchronous, so a row submitted by a task that is being cancelled is still written.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put((to_db(row), fut))
        return fut

    def submit_refusal(self, refusal: Refusal) -> None:
        """Count a refusal, durable with the next commit: at the latest with the next row submitted."""
        key = count_key(refusal)
        with self._refusals_lock:
            wake = not self._refusals
            self._refusals[key] += 1
        if wake:
            self._queue.put(_WAKE)

    def record_now(self, rows: list[LedgerRow], refusals: Iterable[Refusal] = ()) -> None:
        """Synchronous write, for tools and tests that run without an event loop."""
        counts = Counter(count_key(r) for r in refusals)
        with _transaction(self._read):
            self._read.executemany(INSERT, [to_db(r) for r in rows])
            self._read.executemany(UPSERT_COUNT, [(*k, n) for k, n in counts.items()])

    # ---- the writer thread ----

    def _writer(self) -> None:
        conn: sqlite3.Connection | None = None
        rows: list[_Pending] = []
        counts: Counter[CountKey] = Counter()
        backoff, stopping, give_up_at = 0.0, False, math.inf
        while True:
            try:
                if backoff:
                    time.sleep(backoff)
                if not stopping:
                    stopping = self._take(rows, block=not backoff)
                with self._refusals_lock:
                    counts.update(self._refusals)
                    self._refusals.clear()
                if rows or counts:
                    conn = conn or self._connect()
                    self._flush(conn, rows, counts)
                    rows, counts, backoff = [], Counter(), 0.0
                if stopping and not rows and not counts:
                    break
            except Exception as exc:  # keep every pending row; retry with backoff; never die
                backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, backoff * 2))
                reason = f"ledger cannot commit: {exc} ({getattr(exc, 'sqlite_errorname', type(exc).__name__)})"
                if reason != self._fault:
                    log.error("ledger: cannot commit %d rows, retrying: %s", len(rows), reason,
                              exc_info=not _not_the_rows_fault(exc))
                self._fault = reason
                _close_quietly(conn)
                conn = None
                if stopping:
                    give_up_at = min(give_up_at, time.monotonic() + self.record_timeout_s)
                    if time.monotonic() >= give_up_at:
                        log.error("ledger: closing with %d rows and %d refusal counts unwritten: %s",
                                  len(rows), len(counts), reason)
                        self._resolve([fut for _, fut in rows], [LedgerUnavailable(reason)] * len(rows))
                        break
        _close_quietly(conn)

    def _take(self, rows: list[_Pending], *, block: bool) -> bool:
        """Move the rows among the next GROUP_MAX queued items into `rows`; True once the stop sentinel was taken."""
        for i in range(GROUP_MAX):
            try:
                item = self._queue.get(block=block and i == 0)
            except queue.Empty:
                break
            if item == _STOP:
                return True
            if item != _WAKE:
                rows.append(item)  # type: ignore[arg-type]
        return False

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self.busy_timeout_s)
        conn.execute("PRAGMA synchronous=FULL")
        if self._on_connect is not None:
            self._on_connect(conn)
        return conn

    def _flush(self, conn: sqlite3.Connection, rows: list[_Pending], counts: Counter[CountKey]) -> None:
        """Commit rows and counts in one transaction; if that fails for a row's fault, again one by one."""
        prune = time.monotonic() >= self._next_prune
        try:
            errors = self._commit(conn, rows, counts, prune=prune, isolate=False)
        except Exception as exc:
            if _not_the_rows_fault(exc):
                raise
            log.warning("ledger: a group of %d rows failed (%s); writing them one by one", len(rows), exc)
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            errors = self._commit(conn, rows, counts, prune=prune, isolate=True)
        if prune:
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
        if self._fault is not None:  # ready again before any waiter hears its row is durable
            log.warning("ledger: writable again after: %s", self._fault)
            self._fault = None
        for (values, _), error in zip(rows, errors, strict=True):
            if error is not None:
                log.error("ledger: row %s refused: %r", values[0], error)
        self._resolve([fut for _, fut in rows], errors)

    def _commit(self, conn: sqlite3.Connection, rows: list[_Pending], counts: Counter[CountKey], *,
                prune: bool, isolate: bool) -> list[Exception | None]:
        """One transaction; with `isolate`, each row in its own savepoint. Returns each row's error."""
        conn.execute("BEGIN IMMEDIATE")
        if isolate:
            errors = [_isolated(conn, INSERT, values) for values, _ in rows]
            for key, n in counts.items():
                if (error := _isolated(conn, UPSERT_COUNT, (*key, n))) is not None:
                    log.error("ledger: refusal count %s dropped: %r", key, error)
        else:
            conn.executemany(INSERT, [values for values, _ in rows])
            conn.executemany(UPSERT_COUNT, [(*key, n) for key, n in counts.items()])
            errors = [None] * len(rows)
        if prune:
            conn.execute("DELETE FROM refusal_counts WHERE minute < ?",
                         (time.time() - self.refusal_retention_days * 86400,))
        conn.execute("COMMIT")
        return errors

    def _resolve(self, futures: list[asyncio.Future[None] | None], errors: list[Exception | None]) -> None:
        """Settle a group's futures on their loop, in one hand-over (one wake-up of the loop, not one a row)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with suppress(RuntimeError):  # the loop closed meanwhile: nobody waits on them any more
            loop.call_soon_threadsafe(_settle, futures, errors)

    # ---- reads ----

    def rows(self, *, tenant: str | None = None, since: float | None = None,
             until: float | None = None) -> list[LedgerRow]:
        return [from_db(r) for r in self._select("requests", COLUMNS, "ts", tenant, since, until)]

    def refusal_counts(self, *, tenant: str | None = None, since: float | None = None,
                       until: float | None = None) -> list[RefusalCount]:
        """Counts per minute; `since` and `until` select whole minutes by their start."""
        return [RefusalCount(*r) for r in self._select("refusal_counts", COUNT_COLUMNS, "minute", tenant, since,
                                                        until)]

    def _select(self, table: str, columns: list[str], time_column: str, tenant: str | None, since: float | None,
                until: float | None) -> list[tuple[Any, ...]]:
        sql, args = f"SELECT {', '.join(columns)} FROM {table} WHERE 1=1", []
        for clause, value in (("tenant = ?", tenant), (f"{time_column} >= ?", since), (f"{time_column} < ?", until)):
            if value is not None:
                sql += f" AND {clause}"
                args.append(value)
        return self._read.execute(sql + f" ORDER BY {time_column}", args).fetchall()

    def get(self, request_id: str) -> LedgerRow | None:
        r = self._read.execute(f"SELECT {', '.join(COLUMNS)} FROM requests WHERE request_id = ?",
                               (request_id,)).fetchone()
        return from_db(r) if r else None


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE … COMMIT on an autocommit connection, ROLLBACK on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _has_old_refusals(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'refusals'").fetchone() is not None


def _isolated(conn: sqlite3.Connection, sql: str, values: tuple[Any, ...]) -> Exception | None:
    """Run one statement in a savepoint: its own error undoes only it; a fault of the database propagates."""
    conn.execute("SAVEPOINT one")
    try:
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


def _close_quietly(conn: sqlite3.Connection | None) -> None:
    if conn is not None:
        with suppress(Exception):
            conn.close()  # rolls back what it had begun


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _settle(futures: list[asyncio.Future[None] | None], errors: list[Exception | None]) -> None:
    for fut, error in zip(futures, errors, strict=True):
        if fut is None or fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
            fut.exception()  # the writer logged it: no "never retrieved" warning if nobody awaits it
