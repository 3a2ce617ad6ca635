"""`SQLiteIdempotency`, the embedded store of Idempotency-Key records (quotas/idempotency.py has the records, the
interface and the bounds): a table in the ledger's database; a claim is written at once (one worker thread owns the
writes' connection), and a `done` record commits in the same transaction as the answer's ledger row (`finish_with_row`
gives the statement the ledger runs with the row), so a row and its stored answer are durable together or not at all.
Reads (a replay, `stored`) and renewals each have a thread and connection of their own: a write waiting on the
database's lock (up to its 5 s busy timeout) held up every call behind it on one thread, another tenant's replay (which
needs no lock under WAL) and renewals too, so that a renewal queued behind claims could end past its lease. A renewal
waits for the lock briefly (`RENEW_BUSY_S`): failed, it is tried again soon (gateway/pipeline/idempotency.py). A claim
waits for the lock until its own deadline, the busy timeout from when it was asked, whatever its turn on the writes'
thread: each waited the whole timeout from its turn, so in a lock-out longer than that (another process's long
transaction) claims were refused one per 5 s, the tenth after 50 s. One whose deadline passed while it queued tries the
lock once, without waiting.

A claim SQLite cannot take now is `LedgerUnavailable` (a retryable 503 at the gateway, before anything is counted,
charged or run), with nothing claimed: busy past its timeout, locked, read-only, out of disk or memory, or failing its
I/O (its transaction rolled back). So is a claim its damaged file refuses (corrupt, or not a database), though that
does not mend by itself: the client is told what is true (nothing ran or was charged; the same key may be sent again,
or the request without it), and the operator is told once, by an error in the log, besides the refusals counted
(`idempotency_unavailable`). A bug (an SQL error, another error code) is still raised as it is. PostgreSQL's: see its
module.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from quotas.idempotency import (
    DEFAULT_LIMITS,
    PRUNE_EVERY,
    Begun,
    Claim,
    Full,
    IdempotencyStore,
    Limits,
    Mismatch,
    Replay,
    Running,
    _decoded,
    _full,
    _kept,
)
from quotas.idempotency_give_ups import GIVE_UP_FOR_S, At, GiveUps
from quotas.idempotency_totals import migrate_sqlite
from quotas.ledger import LedgerUnavailable, Statement

log = logging.getLogger("tiergate.idempotency")

SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    owner TEXT NOT NULL,
    state TEXT NOT NULL,
    answer TEXT,
    expires REAL NOT NULL,
    size INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expires ON idempotency(expires);
"""
BUSY_S = 5.0  # how long a claim, an answer or a give-up waits for the database's write lock
RENEW_BUSY_S = 0.5  # how long a renewal does (the renewals behind it wait no longer); one that failed is tried soon
_SELECT = "SELECT fingerprint, state, answer, expires FROM idempotency WHERE tenant = ? AND key = ?"
# SQLite's primary result codes for a database that cannot take a claim now: BUSY, LOCKED, READONLY, IOERR, FULL,
# CANTOPEN, PROTOCOL; or not until an operator mends its file: CORRUPT, NOTADB (anything else, "no such table"
# included, is a bug: raised as it is). Out of memory (NOMEM) comes as Python's MemoryError: see `_sqlite_fault`
_SQLITE_UNAVAILABLE = frozenset({5, 6, 8, 10, 13, 14, 15})
_SQLITE_DAMAGED = frozenset({11, 26})

# a running claim given up (its request failed, its answer not kept): a retry runs again
_SQLITE_ABANDON = "DELETE FROM idempotency WHERE tenant = ? AND key = ? AND owner = ? AND state = 'running'"
# a running claim's lease extended by its owner (still its owner: an expired claim taken over has another)
_SQLITE_RENEW = "UPDATE idempotency SET expires = ? WHERE tenant = ? AND key = ? AND owner = ? AND state = 'running'"


class SQLiteIdempotency(IdempotencyStore):
    def __init__(self, path: Path, *, clock: Any = time.time, limits: Limits = DEFAULT_LIMITS,
                 busy_s: float = BUSY_S) -> None:
        self._clock = clock
        self.limits = limits
        self._path = path
        self._busy_s = busy_s  # how long a claim waits for the write lock, from when it was asked (the module's doc)
        # writes (claims, answers, give-ups) on one thread and connection; reads and renewals each on their own, so
        # that neither waits behind a write waiting on the lock (see the module's doc)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idempotency")
        self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idempotency-reads")
        self._renewals = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idempotency-renewals")
        self._conn: sqlite3.Connection | None = self._connect()
        self._read_conn: sqlite3.Connection | None = None  # opened by the first read, in its thread
        self._renew_conn: sqlite3.Connection | None = None  # opened by the first renewal, in its thread
        self._conn.executescript(SCHEMA)
        migrate_sqlite(self._conn)
        self._claims = 0
        self._fault: str | None = None  # why claims are refused, since the first refused (logged once)
        self._give_ups = GiveUps(self._abandon_at)  # give-ups SQLite could not take, deleted once it can

    def _connect(self, busy_s: float | None = None) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, isolation_level=None, timeout=self._busy_s if busy_s is None else busy_s,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self._busy_s  # its own, however many claims are ahead of it on the thread
        try:
            # a stored answer is read on the reads' thread, without the database's write lock (a done record changes
            # only when it expires), and decoded there: a replay waits neither for writes waiting on the lock nor
            # holds up the ledger's commits
            begun: Begun | None = await loop.run_in_executor(self._reads, self._replay, tenant, key, fingerprint)
            if begun is None:
                begun = await loop.run_in_executor(self._pool, self._begin, tenant, key, fingerprint, owner, lease_s,
                                                   deadline)
        except (sqlite3.Error, MemoryError) as exc:
            if (found := _sqlite_fault(exc)) is None:
                raise
            fault, level = found
            if fault != self._fault:  # logged once a fault, not once a request: a damaged file refuses every one
                log.log(level, "idempotency claims refused (503) while %s cannot take them: %s", self._path, fault)
            self._fault = fault
            raise LedgerUnavailable(f"the idempotency records cannot be written now: {fault}") from exc
        if self._fault is not None:
            log.warning("idempotency claims written again after: %s", self._fault)
            self._fault = None
        return begun

    def _replay(self, tenant: str, key: str, fingerprint: str) -> Replay | Mismatch | None:
        """The key's live stored answer (or Mismatch for another body), or None: it is claimed, if it can be."""
        found = self._read(tenant, key)
        if found is not None and found[1] == "done" and found[3] > self._clock():
            return _decoded(found[2]) if found[0] == fingerprint else Mismatch()
        return None

    def _read(self, tenant: str, key: str) -> tuple[Any, ...] | None:
        conn = self._read_conn = self._read_conn or self._connect()
        return conn.execute(_SELECT, (tenant, key)).fetchone()

    def _begin(self, tenant: str, key: str, fingerprint: str, owner: str, lease_s: float, deadline: float) -> Begun:
        now = self._clock()
        conn = self._writer(deadline - time.monotonic())  # past its deadline: one try, no wait
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute(_SELECT, (tenant, key)).fetchone()
            if found is None or found[3] <= now:  # a new key, or an expired one (a crashed owner's lease too)
                if found is not None:
                    conn.execute("DELETE FROM idempotency WHERE tenant = ? AND key = ?", (tenant, key))
                begun: Begun | str = self._full(tenant, now) or Claim(tenant, key, fingerprint, owner)
                if isinstance(begun, Claim):
                    conn.execute("INSERT INTO idempotency (tenant, key, fingerprint, owner, state, expires) "
                                 "VALUES (?, ?, ?, ?, 'running', ?)", (tenant, key, fingerprint, owner, now + lease_s))
            elif found[0] != fingerprint:
                begun = Mismatch()
            elif found[1] == "done":  # finished since the first look
                begun = found[2]
            else:
                begun = Running()
            self._claims += 1
            if self._claims % PRUNE_EVERY == 0:
                conn.execute("DELETE FROM idempotency WHERE expires <= ?", (now,))
            conn.execute("COMMIT")
        except BaseException:
            self._roll_back(conn)
            raise
        return _decoded(begun) if isinstance(begun, str) else begun

    def _writer(self, busy_s: float) -> sqlite3.Connection:
        """The writes' connection, its next statement waiting `busy_s` at most for the database's lock (none if 0)."""
        conn = self._conn = self._conn or self._connect()
        conn.execute(f"PRAGMA busy_timeout = {max(0, round(busy_s * 1000))}")
        return conn

    def _roll_back(self, conn: sqlite3.Connection) -> None:
        """Roll back a claim that failed, if SQLite did not (it does for a full disk, an I/O error). A rollback that
        fails too (out of memory: preparing it takes some) would leave the transaction open with the write lock, which
        the ledger's writer waits for, and every later claim refused as a transaction within a transaction: the
        connection is closed instead (SQLite rolls it back), and the next call opens another."""
        if not conn.in_transaction:
            return
        try:
            conn.execute("ROLLBACK")
        except (sqlite3.Error, MemoryError):
            self._conn = None
            conn.close()

    def _full(self, tenant: str, now: float) -> Full | None:
        """None if the tenant has room for a new key (one row read); at its bound, its expired records are deleted
        first, so that only live ones count."""
        conn = self._conn
        held = "SELECT records, bytes FROM idempotency_tenants WHERE tenant = ?"
        if self.limits.room(*(conn.execute(held, (tenant,)).fetchone() or (0, 0))):
            return None
        pruned = conn.execute("DELETE FROM idempotency WHERE tenant = ? AND expires <= ?", (tenant, now)).rowcount
        if pruned and self.limits.room(*conn.execute(held, (tenant,)).fetchone()):
            return None
        first = conn.execute("SELECT expires FROM idempotency WHERE tenant = ? ORDER BY expires LIMIT 1",
                             (tenant,)).fetchone()
        return _full(now, first[0] if first else None)

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        text, size = _kept(answer, self.limits)
        return (("UPDATE idempotency SET state = 'done', answer = ?, size = ?, expires = ? WHERE tenant = ? AND "
                 "key = ? AND owner = ?", (text, size, self._clock() + ttl_s, claim.tenant, claim.key,
                                           claim.owner)),)

    async def finish_alone(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        statements = self.finish_with_row(claim, answer, ttl_s)
        await asyncio.get_running_loop().run_in_executor(self._pool, self._execute, statements)

    def _execute(self, statements: tuple[Statement, ...]) -> None:
        """`statements` on the writes' connection (in their one thread), rolled back if one fails."""
        conn = self._writer(self._busy_s)
        try:
            for sql, args in statements:
                conn.execute(sql, args)
        except BaseException:
            self._roll_back(conn)
            raise

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """On the renewals' thread, waiting `RENEW_BUSY_S` at most for the lock; `LedgerUnavailable` when SQLite
        cannot take it now (the next try is soon: gateway/pipeline/idempotency.py)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._renewals, self._renew, claim, lease_s)
        except (sqlite3.Error, MemoryError) as exc:
            if (found := _sqlite_fault(exc)) is None:
                raise
            raise LedgerUnavailable(f"an idempotency claim's lease cannot be renewed now: {found[0]}") from exc

    def _renew(self, claim: Claim, lease_s: float) -> bool:
        conn = self._renew_conn = self._renew_conn or self._connect(RENEW_BUSY_S)
        args = (self._clock() + lease_s, claim.tenant, claim.key, claim.owner)
        return conn.execute(_SQLITE_RENEW, args).rowcount > 0

    async def stored(self, tenant: str, key: str, fingerprint: str) -> Replay | Mismatch | None:
        found = await asyncio.get_running_loop().run_in_executor(self._reads, self._read, tenant, key)
        if found is None or found[1] != "done" or found[3] <= self._clock():
            return None
        return _decoded(found[2]) if found[0] == fingerprint else Mismatch()

    async def abandon(self, claim: Claim) -> None:
        """Give the claim up; one SQLite cannot take now (busy past its timeout, locked, full...) is owed and given up
        in the background once it can (quotas/idempotency_give_ups.py, as PostgreSQL's), never left to hold the key
        for its lease, every retry told 409 meanwhile."""
        at = (claim.tenant, claim.key, claim.owner)
        try:
            await self._abandon_at(at)
        except LedgerUnavailable:
            self._give_ups.owe(at, GIVE_UP_FOR_S)

    async def _abandon_at(self, at: At) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._execute, ((_SQLITE_ABANDON, at),))
        except (sqlite3.Error, MemoryError) as exc:
            if (found := _sqlite_fault(exc)) is None:
                raise
            raise LedgerUnavailable(f"an idempotency claim cannot be given up now: {found[0]}") from exc

    async def close(self) -> None:
        await self._give_ups.close()
        for pool in (self._pool, self._reads, self._renewals):
            pool.shutdown(wait=True)
        for conn in (self._conn, self._read_conn, self._renew_conn):
            if conn is not None:
                conn.close()


def _sqlite_fault(exc: BaseException) -> tuple[str, int] | None:
    """Why SQLite cannot take a claim and how loud to log it, or None for a bug: an error for a damaged file (it does
    not mend by itself) or memory short, a warning for the rest (busy, full, read-only...). Out of memory is Python's
    MemoryError (the sqlite3 module raises it for SQLite's NOMEM), and so is the process's own: either way the claim
    was rolled back."""
    if isinstance(exc, MemoryError):
        return "out of memory", logging.ERROR
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code in _SQLITE_DAMAGED:
        return f"{exc}: the file is damaged; restore it from a backup or recover it (sqlite3's .recover)", logging.ERROR
    return (str(exc), logging.WARNING) if code in _SQLITE_UNAVAILABLE else None
