"""Idempotency-Key records, as Stripe defines them: per tenant, a key's first request runs and its answer is
stored; a retry with the same key and body gets that answer again, charged nothing more.

A record is `running` (claimed by one request, with a lease, so a crashed owner does not hold the key
forever) or `done` (the stored answer, kept for the plan's TTL). The key's fingerprint is the request's
canonical body, so the same key with another body is told apart.

Three stores behind one interface:
- `SQLiteIdempotency` (embedded): a table in the ledger's database; a claim is written at once (one worker
  thread owns the writes' connection), and a `done` record commits in the same transaction as the answer's ledger
  row (`finish_with_row` gives the statement the ledger runs with the row), so a row and its stored answer
  are durable together or not at all. Reads (a replay, `stored`) and renewals each have a thread and connection
  of their own: a write waiting on the database's lock (up to its 5 s busy timeout) held up every call behind it
  on one thread, another tenant's replay (which needs no lock under WAL) and renewals too, so that a renewal
  queued behind claims could end past its lease. A renewal waits for the lock briefly (`RENEW_BUSY_S`): failed,
  it is tried again soon (gateway/pipeline/idempotency.py). A claim waits for the lock until its own deadline, the
  busy timeout from when it was asked, whatever its turn on the writes' thread: each waited the whole timeout from its
  turn, so in a lock-out longer than that (another process's long transaction) claims were refused one per 5 s, the
  tenth after 50 s. One whose deadline passed while it queued tries the lock once, without waiting.
- `PostgresIdempotency` (a fleet, quotas/idempotency_postgres.py): the same table in the fleet database, beside the
  ledger's tables; a claim is one statement on a connection of the async pool, and the `done` record commits with the
  ledger row, as in SQLite, so any replica replays an answer whose row any replica wrote.
- `RedisIdempotency` (replicas, quotas/idempotency_redis.py): the record in Redis, claimed and finished by Lua
  scripts, so a replica that did not serve the first request replays it too.

What one tenant may hold is bounded (`Limits`), on every store: every key stores a copy of its answer for the TTL
(24 h), and a cached answer repeated under fresh keys is free, so without a bound one tenant's records could fill
the disk the ledger writes to, for every tenant. A new key is refused (`Full`, a 429 before any work) while the
tenant's live records reach `records`, or their stored answers `bytes`; expired records do not count, and a
replay or a retry of a key already held is never refused. An answer over `answer_bytes` is not stored, but its key
is kept as answered: a small record (`NOT_KEPT`, with the answer's size) takes the answer's place, committed with its
ledger row, so a retry with the key is told it ran and was too large to keep (the gateway's 409), never run and
charged again. Given up instead, as it was, every retry of such an answer (a long one with log-probabilities) ran
and was charged once more.
The count is kept where a new key is claimed, so it costs the hot path no scan: SQLite keeps per-tenant totals by
triggers, Redis a per-tenant sorted set of live keys and a hash of their sizes, PostgreSQL a totals row per tenant
kept by triggers, which a claim of a new key locks while it checks and inserts (quotas/idempotency_totals.py). Each
is exact: SQLite and Redis serialize claims, PostgreSQL a tenant's claims of new keys. Expired records count until
deleted: a tenant at its bound deletes its own before it is refused.

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
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

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
PRUNE_EVERY = 1000  # claims between deletions of expired records
BUSY_S = 5.0  # how long a claim, an answer or a give-up waits for the database's write lock
RENEW_BUSY_S = 0.5  # how long a renewal does (the renewals behind it wait no longer); one that failed is tried soon
# a tenant's bounds (the gateway's Settings do not carry them yet: these constants are what it runs with)
MAX_RECORDS_PER_TENANT = 10_000  # live keys (running or done)
MAX_BYTES_PER_TENANT = 256 * 1024 * 1024  # stored answers of its live keys (UTF-8 JSON)
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # one stored answer (the largest request body the gateway accepts, too)
_SELECT = "SELECT fingerprint, state, answer, expires FROM idempotency WHERE tenant = ? AND key = ?"
# SQLite's primary result codes for a database that cannot take a claim now: BUSY, LOCKED, READONLY, IOERR, FULL,
# CANTOPEN, PROTOCOL; or not until an operator mends its file: CORRUPT, NOTADB (anything else, "no such table"
# included, is a bug: raised as it is). Out of memory (NOMEM) comes as Python's MemoryError: see `_sqlite_fault`
_SQLITE_UNAVAILABLE = frozenset({5, 6, 8, 10, 13, 14, 15})
_SQLITE_DAMAGED = frozenset({11, 26})


@dataclass(frozen=True)
class Claim:
    """This request owns the key: it runs, and its answer is stored (or the claim abandoned)."""

    tenant: str
    key: str
    fingerprint: str
    owner: str  # the request id that claimed it


@dataclass(frozen=True)
class Replay:
    """The key's first request finished: its answer, to be sent again."""

    answer: dict[str, Any]


@dataclass(frozen=True)
class Running:
    """The key's first request is still running."""


@dataclass(frozen=True)
class Mismatch:
    """The key was used with another request body."""


@dataclass(frozen=True)
class Full:
    """The tenant holds as many live records (or stored bytes) as it may: a new key waits until some expire."""

    retry_after_s: float  # until the tenant's first live record expires


Begun = Claim | Replay | Running | Mismatch | Full


@dataclass(frozen=True)
class Limits:
    """What one tenant may hold: a new key is refused at `records` live records or `bytes` stored; an answer over
    `answer_bytes` is not stored (`NOT_KEPT` stands in for it). The bytes may be passed by the answers of claims in
    flight (each under `answer_bytes`): a claim is checked before its answer exists."""

    records: int = MAX_RECORDS_PER_TENANT
    bytes: int = MAX_BYTES_PER_TENANT
    answer_bytes: int = MAX_ANSWER_BYTES

    def room(self, records: int, stored: int) -> bool:
        return records < self.records and stored < self.bytes


DEFAULT_LIMITS = Limits()
# what a `done` record holds in place of an answer over `Limits.answer_bytes`: {NOT_KEPT: its size in bytes}
NOT_KEPT = "tiergate_answer_not_kept"


def not_kept(answer: dict[str, Any]) -> int | None:
    """The size of the answer a stored record stands in for (`NOT_KEPT`), or None: the record is the answer."""
    return answer.get(NOT_KEPT)


def _full(now: float, first_expires: float | None) -> Full:
    return Full(max(1.0, first_expires - now) if first_expires is not None else 1.0)


class IdempotencyStore(ABC):
    limits = DEFAULT_LIMITS  # what one tenant may hold (each store enforces it where a new key is claimed)

    @abstractmethod
    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        """Claim `key` for `owner`, or say why not (its answer, still running, another body, no room for a new key)."""

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        """Statements that store the answer in the same ledger transaction as its row (none: see `finish`)."""
        return ()

    async def finish(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:  # noqa: B027
        """Store the answer, for stores that cannot commit with the ledger row (called once it is durable)."""

    async def finish_alone(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        """Store an answer whose ledger row is already durable without it, in a write of its own (a cascade's first
        answer, which stands when its retry failed: gateway/pipeline/cascade.py). Raises if the store cannot."""
        await self.finish(claim, answer, ttl_s)

    @abstractmethod
    async def abandon(self, claim: Claim) -> None:
        """The request failed or its client left: a retry runs again."""

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """Extend `claim`'s lease to `lease_s` from now while its request runs, if the record is still its running
        claim (False when not: answered, given up, or taken over by another request after it expired). Without it an
        answer running past its lease (a long stream) let a retry with its key take the key over, run and be charged a
        second time (gateway/pipeline/idempotency.py renews it every third of the lease, and a renewal that raised a
        thirtieth later). False, or no renewal before the lease may end, and the gateway stops the request: a retry
        may take the key over. A store that cannot renew says False."""
        return False

    async def stored(self, tenant: str, key: str, fingerprint: str) -> Replay | Mismatch | None:
        """The key's stored answer (or Mismatch for another body), read only: nothing is claimed or written, so it is
        asked while the ledger cannot write (a replay writes no row); None when the key holds no answer (new, running
        or expired). A store that cannot read without writing says None: the request is refused as any other."""
        return None

    def finish_when_written(self, written: asyncio.Future[None], claim: Claim, answer: dict[str, Any],
                            ttl_s: float) -> None:
        """Follow the ledger row of `claim`'s answer (`written`, the ledger's future for it) still pending after the
        gateway's wait for it (gateway/pipeline/idempotency.py's `keep_when_written`), however late its fate is
        final, with no task held open meanwhile (a shutdown does not wait on it): a row that commits keeps the answer
        (`finish`; SQLite and PostgreSQL committed it with the row), a row refused for good gives the claim up, so a
        retry runs. The ledger settles every row's future: committed, refused, or failed as it closes."""
        written.add_done_callback(lambda row: _follow(self, row, claim, answer, ttl_s))

    async def close(self) -> None:  # noqa: B027
        """Release connections."""


_FOLLOWING: set[asyncio.Task[None]] = set()  # `finish_when_written`'s work, held until it ends


def _follow(store: IdempotencyStore, row: asyncio.Future[None], claim: Claim, answer: dict[str, Any],
            ttl_s: float) -> None:
    """`finish_when_written`'s end: the row's fate is final."""
    refused = row.cancelled() or row.exception() is not None
    task = asyncio.get_running_loop().create_task(store.abandon(claim) if refused else
                                                  store.finish(claim, answer, ttl_s))
    _FOLLOWING.add(task)
    task.add_done_callback(_followed)


def _followed(task: asyncio.Task[None]) -> None:
    _FOLLOWING.discard(task)
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("keeping or giving up an Idempotency-Key after its late ledger row failed: %s", exc)


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


def _decoded(stored: str | bytes) -> Replay:
    """A stored answer to replay (msgspec: several times json.loads' speed on megabytes of logprobs)."""
    return Replay(msgspec.json.decode(stored))


def _kept(answer: dict[str, Any], limits: Limits) -> tuple[str, int]:
    """What a `done` record stores of `answer`, as JSON text, and its size: the answer, or over `limits.answer_bytes`
    the record that stands in for it (`NOT_KEPT`)."""
    text, size = _encoded(answer)
    return _encoded({NOT_KEPT: size}) if size > limits.answer_bytes else (text, size)


def _encoded(answer: dict[str, Any]) -> tuple[str, int]:
    """The answer as JSON text and its size in bytes (UTF-8), on the event loop: msgspec's encoder (Litestar's
    own), several times json.dumps' speed on an answer with logprobs (megabytes at 20 alternatives a token), the
    same value read back."""
    encoded = msgspec.json.encode(answer)
    return encoded.decode(), len(encoded)
