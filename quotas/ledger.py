"""The usage ledger's interface and its writer: one durable row per finished request, refusal counts.

Two implementations: `SQLiteLedger` (quotas/ledger_sqlite.py, a file in the data directory: the embedded
default) and `PostgresLedger` (quotas/ledger_postgres.py, the fleet database: every replica's rows in one
place). `Ledger(path)` opens the embedded one, as `pathlib.Path(...)` picks its flavour, so `Ledger` is both
the type every user of a ledger names and the way tools and tests open a data directory's. They share
everything here: rows are queued from the event loop and one thread writes them in grouped
transactions (one commit for many requests); `wait_durable` returns only once its row is committed, so a
response the client received is never missing, even if the gateway is killed right after. The writer never
dies and drops no row it could still write: a row the database refuses (a duplicate id, a value it cannot
hold) fails only its own future, as a failed group is retried row by row; a fault of the database (disk
full, locked, connection lost, I/O error) keeps every pending row and makes the ledger not ready until a
retry, with backoff, commits, so the gateway refuses new work rather than serve unbilled. A row whose client
will be told only an error if it is late (a JSON answer) is withdrawn when its wait runs out, unless its commit is
already under way: then that commit decides (`wait_durable`), so the client's answer never contradicts the bill.
Refusals are counted per minute, tenant, key, reason and status, not stored one by one, with a retention.

What an implementation supplies: a writer connection, one group's transaction, which errors are the
database's fault, and the reads (quotas/ledger_reads.py, which read-only readers in other processes share).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any

from quotas.ledger_reads import LedgerReads, ReadSource
from quotas.ledger_rows import CountKey, LedgerRow, Refusal, count_key, to_db
from quotas.ledger_withdrawals import LedgerUnavailable, RowWithdrawn, Withdrawals, until, wake

log = logging.getLogger("tiergate.ledger")
Statement = tuple[str, tuple[Any, ...]]  # SQL and its parameters
# a row's values, who waits on it, and statements that must commit with it (an idempotency record)
Pending = tuple[tuple[Any, ...], asyncio.Future[None] | None, tuple[Statement, ...]]
_WAKE, _STOP = "wake", "stop"

GROUP_MAX = 512  # rows taken from the queue per commit at most
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0  # between retries while the ledger cannot commit
PRUNE_EVERY_S = 3600.0  # refusal counts past their retention are deleted at most this often


class LedgerReadLocked(Exception):
    """A read under `Ledger.lock_bounded_reads` gave up waiting for another session's lock on the ledger's tables (an
    operator's LOCK TABLE, an ALTER): nothing was read or changed, and the same read later may work."""


class Ledger(LedgerReads, ABC):
    """`submit` rows and `submit_refusal`s from the event loop; read back with `rows`, `refusal_counts` and the
    totals reports use (quotas/ledger_reads.py). `ready` is False while the writer cannot commit (or is not
    running); `not_ready_reason` says why."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Ledger:
        if cls is Ledger:  # `Ledger(path, ...)`: the embedded SQLite ledger
            from quotas.ledger_sqlite import SQLiteLedger

            cls = SQLiteLedger
        return super().__new__(cls)

    def __init__(self, *, record_timeout_s: float, busy_timeout_s: float, refusal_retention_days: float) -> None:
        self.record_timeout_s = record_timeout_s
        self.busy_timeout_s = busy_timeout_s
        self.refusal_retention_days = refusal_retention_days
        # the C queue: a put from the event loop costs ~0.1 us where queue.Queue's lock and Condition cost ~2 us,
        # and the writer's get holds the GIL as briefly (nothing here needs Queue's join, size bound or task_done)
        self._queue: queue.SimpleQueue[list[Pending] | str] = queue.SimpleQueue()
        self._outbox: list[Pending] = []  # submitted during this turn of the event loop, not yet queued
        self._refusals: Counter[CountKey] = Counter()  # counted since the writer last took them
        self._refusals_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fault: str | None = None  # why the last commit failed, until one succeeds
        self._next_prune = 0.0
        self._withdrawals = Withdrawals()  # which pending rows `wait_durable` may still withdraw

    # ---- what an implementation supplies ----

    @abstractmethod
    def _connect(self) -> Any:
        """A new connection for the writer thread."""

    @abstractmethod
    def _commit(self, conn: Any, rows: list[Pending], counts: Counter[CountKey], *, prune: bool,
                isolate: bool) -> list[Exception | None]:
        """One transaction for the rows (each with its statements) and counts, rolled back on any error; with
        `isolate`, each row in its own savepoint, so its own error undoes only it. Returns each row's error."""

    # whether a commit that raised may have committed all the same (its reply lost on the way back: `_landed`)
    COMMIT_IN_DOUBT_AFTER_FAILURE = False

    def _landed(self, conn: Any, rows: list[Pending]) -> list[bool] | None:
        """Asked on a new connection after a commit failed, before its rows are sent again: None if it did not
        commit, else which of its `rows` it wrote (it committed, and its reply was lost on the way back: sent
        again, each would be refused as a duplicate of itself). Raises while the database cannot tell yet. A
        SQLite commit is local: one that raised did not commit."""
        return None

    @abstractmethod
    def _is_db_fault(self, exc: BaseException) -> bool:
        """A fault of the database or its disk (retry later), not one the row's values caused (refuse the row)."""

    @abstractmethod
    def mark_fallback_applied(self, request_ids: Sequence[str]) -> None:
        """Note that Redis' counters have the money of these fallback rows (`fallback_pending` skips them); a
        repeat changes nothing. Blocking: call it off the event loop."""

    @abstractmethod
    def read_source(self) -> ReadSource:
        """Where its rows are, for a read-only reader in another process (quotas/ledger_reads.py `open_reader`)."""

    @abstractmethod
    def record_now(self, rows: list[LedgerRow], refusals: Iterable[Refusal] = ()) -> None:
        """Synchronous write, for tools and tests that run without an event loop."""

    @abstractmethod
    def _close_reads(self) -> None:
        """Release what the reads hold."""

    def _fault_name(self, exc: BaseException) -> str:
        return type(exc).__name__

    def lock_bounded_reads(self) -> AbstractContextManager[None]:
        """Reads on this thread within it wait for another session's table lock at most a short bound, then raise
        `LedgerReadLocked` (PostgreSQL, quotas/ledger_postgres.py); SQLite's are as ever (no table locks there)."""
        return nullcontext()

    # ---- running ----

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
            self._post()
            self._queue.put(_STOP)
            self._thread.join(timeout=self.record_timeout_s + self.busy_timeout_s + 5)
            self._thread = None
        self._close_reads()

    async def record(self, row: LedgerRow, *, timeout_s: float | None = None) -> None:
        """Write `row`; returns once it is durable (see `wait_durable` for the errors)."""
        await self.wait_durable(self.submit(row), timeout_s=timeout_s)

    async def wait_durable(self, written: asyncio.Future[None], *, timeout_s: float | None = None,
                           withdraw: bool = False) -> None:
        """Wait for a row `submit` queued; returns once it is durable.

        Raises `LedgerUnavailable` when it is not durable within `timeout_s` (default: `record_timeout_s`): the row
        stays queued and is written once the ledger can commit again, for a caller whose client has what the row
        bills (a stream's tokens). Raises the row's own error when the database refuses it (a duplicate request id,
        a value it cannot hold). Cancelling the caller never cancels the row.

        With `withdraw` (a caller whose client gets only an error if this raises: a JSON answer), the row not durable
        in time is withdrawn, so that the error never contradicts the bill: still queued, it is taken out of the
        batches to come and never commits (`RowWithdrawn`); already sent to commit, its commit decides and this
        waits for it, however long: committed, this returns (the client gets the answer it is billed for); not
        committed, it is withdrawn then (`RowWithdrawn`). A commit that raised is in doubt where the database may
        have committed it as its reply was lost (PostgreSQL: `_landed`): it stays the commit's until the writer
        has asked, and this waits for that too. Waiting on is the only answer that cannot contradict a commit whose
        fate nobody knows yet; a row still queued is withdrawn at once, and only the rows of one commit can be in
        flight at a time. Everything that follows the row's future (an Idempotency-Key's answer committed with it,
        a fallback reservation's money) sees the withdrawal as a row that failed: nothing was written.

        A row whose withdrawal is pending (asked while it was in flight) is waited for to its end by any caller,
        whatever `timeout_s`: its fate is the commit's, and what settles with it must not guess.
        """
        timeout_s = self.record_timeout_s if timeout_s is None else timeout_s
        if not written.done():  # (inline, not `until`: every answer waits here, and a frame less is ~1 us)
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            written.add_done_callback(lambda _: wake(waiter))
            timer = loop.call_later(timeout_s, wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
        if written.done():
            written.result()  # the row's own error, if the database refused it (or `RowWithdrawn`)
            return
        if withdraw:
            self._withdrawals.withdraw(written)
        if not written.done() and self._withdrawals.pending(written):
            await until(written, None)
        if not written.done():
            why = self.not_ready_reason or "the ledger writer is behind"
            raise LedgerUnavailable(f"a usage row was not durable after {timeout_s:g} s: {why}")
        written.result()  # the row's own error, if the database refused it (or `RowWithdrawn`)

    def submit(self, row: LedgerRow, *, with_row: tuple[Statement, ...] = ()) -> asyncio.Future[None]:
        """Queue `row` for the next group commit; the future resolves once it is durable (`wait_durable`).
        `with_row` statements commit in the same transaction as the row, or not at all.

        Queuing is synchronous, so a row submitted by a task that is being cancelled is still written: the
        rows submitted during one turn of the event loop go to the writer together at its end (one hand-over
        between threads, not one a row: each costs the loop a lock the writer may hold).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._outbox.append((to_db(row), fut, with_row))
        if len(self._outbox) == 1:
            loop.call_soon(self._post)
        return fut

    def _post(self) -> None:
        rows, self._outbox = self._outbox, []
        if rows:
            self._queue.put(rows)

    def submit_refusal(self, refusal: Refusal) -> None:
        """Count a refusal, durable with the next commit: at the latest with the next row submitted."""
        key = count_key(refusal)
        with self._refusals_lock:
            wake = not self._refusals
            self._refusals[key] += 1
        if wake:
            self._queue.put(_WAKE)

    # ---- the writer thread ----

    def _writer(self) -> None:
        conn: Any = None
        rows: list[Pending] = []
        counts: Counter[CountKey] = Counter()
        backoff, stopping, give_up_at = 0.0, False, math.inf
        doubt: tuple[int, Counter[CountKey]] | None = None  # the failed commit's rows (the first n) and counts
        while True:
            try:
                if backoff:
                    time.sleep(backoff)
                if not stopping:
                    stopping = self._take(rows, block=not backoff)
                with self._refusals_lock:
                    counts.update(self._refusals)
                    self._refusals.clear()
                if conn is None and doubt is not None:  # what the failed commit wrote is not sent again
                    conn = self._connect()
                    rows, counts = self._after_doubt(conn, rows, counts, doubt)
                    doubt = None
                rows = self._withdrawals.claim(rows)  # in flight from here: their commit decides
                # nothing left to write after a failure (its rows withdrawn): an empty commit tells when the
                # ledger can commit again, or it would stay not ready, refusing the work that would write a row
                if rows or counts or (backoff and not stopping):
                    conn = conn or self._connect()
                    doubt = (len(rows), counts.copy())
                    self._flush(conn, rows, counts)
                    rows, counts, backoff, doubt = [], Counter(), 0.0, None
                if stopping and not rows and not counts:
                    break
            except Exception as exc:  # keep every pending row; retry with backoff; never die
                if doubt is None or not self.COMMIT_IN_DOUBT_AFTER_FAILURE:  # nothing of it committed
                    doubt = None
                    rows = self._returned(rows)
                backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, backoff * 2))
                reason = f"ledger cannot commit: {str(exc).strip()} ({self._fault_name(exc)})"
                if reason != self._fault:
                    log.error("ledger: cannot commit %d rows, retrying: %s", len(rows), reason,
                              exc_info=not self._is_db_fault(exc))
                self._fault = reason
                _close_quietly(conn)
                conn = None
                if stopping:
                    give_up_at = min(give_up_at, time.monotonic() + self.record_timeout_s)
                    if time.monotonic() >= give_up_at:
                        log.error("ledger: closing with %d rows and %d refusal counts unwritten: %s",
                                  len(rows), len(counts), reason)
                        self._resolve([fut for _, fut, _ in rows], [LedgerUnavailable(reason)] * len(rows))
                        break
        _close_quietly(conn)

    def _after_doubt(self, conn: Any, rows: list[Pending], counts: Counter[CountKey],
                     doubt: tuple[int, Counter[CountKey]]) -> tuple[list[Pending], Counter[CountKey]]:
        """The rows and counts still to write once the failed commit's fate is known: if it committed, its
        counts and the rows it wrote are done (their waiters told they are durable), the others kept."""
        n, sent = doubt
        wrote = self._landed(conn, rows[:n])
        if wrote is None:
            return self._returned(rows[:n]) + rows[n:], counts
        done = [p for p, w in zip(rows[:n], wrote, strict=True) if w]
        log.warning("ledger: a commit whose reply was lost had committed; its %d rows are not written again",
                    len(done))
        if self._fault is not None:  # ready again before any waiter hears its row is durable
            self._fault = None
        self._resolve([fut for _, fut, _ in done], [None] * len(done))
        return self._returned([p for p, w in zip(rows[:n], wrote, strict=True) if not w]) + rows[n:], counts - sent

    def _returned(self, rows: list[Pending]) -> list[Pending]:
        """Rows back from a commit that did not write them, queued again; those whose withdrawal was asked meanwhile
        are withdrawn now (their futures fail with `RowWithdrawn`)."""
        back, gone = self._withdrawals.returned(rows)
        if gone:
            log.warning("ledger: %d rows not durable in time were withdrawn after their commit failed", len(gone))
            self._resolve(list(gone), [RowWithdrawn("a usage row was withdrawn: its commit failed") for _ in gone])
        return back

    def _take(self, rows: list[Pending], *, block: bool) -> bool:
        """Move queued rows into `rows`, about GROUP_MAX at most; True once the stop sentinel was taken."""
        first = True
        while len(rows) < GROUP_MAX:
            try:
                item = self._queue.get(block=block and first)
            except queue.Empty:
                break
            first = False
            if item == _STOP:
                return True
            if item != _WAKE:
                rows.extend(item)
        return False

    def _flush(self, conn: Any, rows: list[Pending], counts: Counter[CountKey]) -> None:
        """Commit rows and counts in one transaction; if that fails for a row's fault, again one by one."""
        prune = time.monotonic() >= self._next_prune
        try:
            errors = self._commit(conn, rows, counts, prune=prune, isolate=False)
        except Exception as exc:
            if self._is_db_fault(exc):
                raise
            log.warning("ledger: a group of %d rows failed (%s); writing them one by one", len(rows), exc)
            errors = self._commit(conn, rows, counts, prune=prune, isolate=True)
        if prune:
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
        if self._fault is not None:  # ready again before any waiter hears its row is durable
            log.warning("ledger: writable again after: %s", self._fault)
            self._fault = None
        for (values, _, _), error in zip(rows, errors, strict=True):
            if error is not None:
                log.error("ledger: row %s refused: %r", values[0], error)
        self._resolve([fut for _, fut, _ in rows], errors)
        try:  # the group is committed and its waiters told: nothing here may make it be written again
            self._after_commit(conn)
        except Exception:
            log.exception("ledger: upkeep after a commit failed")

    def _after_commit(self, conn: Any) -> None:
        """Upkeep after a group's waiters have heard (the SQLite ledger's checkpoints); must not raise."""

    def _prune_before(self) -> float:
        return time.time() - self.refusal_retention_days * 86400

    def _resolve(self, futures: list[asyncio.Future[None] | None], errors: list[Exception | None]) -> None:
        """Settle a group's futures on their loop, in one hand-over (one wake-up of the loop, not one a row)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with suppress(RuntimeError):  # the loop closed meanwhile: nobody waits on them any more
            loop.call_soon_threadsafe(self._settle_on_loop, futures, errors)

    def _settle_on_loop(self, futures: list[asyncio.Future[None] | None], errors: list[Exception | None]) -> None:
        """The futures settled, and no longer in flight: in one turn of the loop, so no withdrawal comes between."""
        _settle(futures, errors)
        self._withdrawals.settled(futures)


def _close_quietly(conn: Any) -> None:
    if conn is not None:
        with suppress(Exception):
            conn.close()  # rolls back what it had begun


def _settle(futures: list[asyncio.Future[None] | None], errors: list[Exception | None]) -> None:
    for fut, error in zip(futures, errors, strict=True):
        if fut is None or fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
            fut.exception()  # the writer logged it: no "never retrieved" warning if nobody awaits it
