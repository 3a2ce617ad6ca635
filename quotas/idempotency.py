"""Idempotency-Key records, as Stripe defines them: per tenant, a key's first request runs and its answer is
stored; a retry with the same key and body gets that answer again, charged nothing more.

A record is `running` (claimed by one request, with a lease, so a crashed owner does not hold the key
forever) or `done` (the stored answer, kept for the plan's TTL). The key's fingerprint is the request's
canonical body, so the same key with another body is told apart.

Three stores behind one interface:
- `SQLiteIdempotency` (embedded): a table in the ledger's database; a claim is written at once (one worker
  thread owns the connection), and a `done` record commits in the same transaction as the answer's ledger
  row (`finish_with_row` gives the statement the ledger runs with the row), so a row and its stored answer
  are durable together or not at all.
- `PostgresIdempotency` (a fleet): the same table in the fleet database, beside the ledger's tables; a claim
  is one statement on a connection of the async pool, and the `done` record commits with the ledger row, as
  in SQLite, so any replica replays an answer whose row any replica wrote.
- `RedisIdempotency` (replicas, quotas/idempotency_redis.py): the record in Redis, claimed and finished by Lua
  scripts, so a replica that did not serve the first request replays it too.

What one tenant may hold is bounded (`Limits`), on every store: every key stores a copy of its answer for the TTL
(24 h), and a cached answer repeated under fresh keys is free, so without a bound one tenant's records could fill
the disk the ledger writes to, for every tenant. A new key is refused (`Full`, a 429 before any work) while the
tenant's live records reach `records`, or their stored answers `bytes`; expired records do not count, and a
replay or a retry of a key already held is never refused. An answer over `answer_bytes` is not stored: its claim
is given up with its ledger row, so the request is answered and a retry with its key runs (and is charged) again.
The count is kept where a new key is claimed, so it costs the hot path no scan: SQLite keeps per-tenant totals by
triggers, Redis a per-tenant sorted set of live keys and a hash of their sizes, PostgreSQL a totals row per tenant
kept by triggers, which a claim of a new key locks while it checks and inserts (quotas/idempotency_totals.py). Each
is exact: SQLite and Redis serialize claims, PostgreSQL a tenant's claims of new keys. Expired records count until
deleted: a tenant at its bound deletes its own before it is refused.

A claim the database cannot take now is `LedgerUnavailable` (a retryable 503 at the gateway, before anything is counted,
charged or run), with nothing claimed: SQLite busy past its timeout, locked, read-only, out of disk or failing its I/O
(its transaction rolled back); PostgreSQL's connection lost or not had in time, a deadlock, a lock or statement
timeout, a shutdown, a read-only server (a failover). A bug (an SQL error, another error code) is still raised as it
is. A PostgreSQL claim whose reply was lost may have committed: it is sent again at once, and a running record of the
same request (its owner, a request id no other request has) is its claim; if that fails too, the record it may have
made is given up in the background once the database answers, so the client's retry is not told 409 for the lease.
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
# a tenant's bounds (the gateway's Settings do not carry them yet: these constants are what it runs with)
MAX_RECORDS_PER_TENANT = 10_000  # live keys (running or done)
MAX_BYTES_PER_TENANT = 256 * 1024 * 1024  # stored answers of its live keys (UTF-8 JSON)
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # one stored answer (the largest request body the gateway accepts, too)
_SELECT = "SELECT fingerprint, state, answer, expires FROM idempotency WHERE tenant = ? AND key = ?"
# SQLite's primary result codes for a database that cannot take a claim now: BUSY, LOCKED, READONLY, IOERR, FULL,
# CANTOPEN, PROTOCOL (anything else, "no such table" included, is a bug: raised as it is)
_SQLITE_UNAVAILABLE = frozenset({5, 6, 8, 10, 13, 14, 15})


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
    `answer_bytes` is not stored. The bytes may be passed by the answers of claims in flight (each under
    `answer_bytes`): a claim is checked before its answer exists."""

    records: int = MAX_RECORDS_PER_TENANT
    bytes: int = MAX_BYTES_PER_TENANT
    answer_bytes: int = MAX_ANSWER_BYTES

    def room(self, records: int, stored: int) -> bool:
        return records < self.records and stored < self.bytes


DEFAULT_LIMITS = Limits()


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

    @abstractmethod
    async def abandon(self, claim: Claim) -> None:
        """The request failed or its client left: a retry runs again."""

    async def close(self) -> None:  # noqa: B027
        """Release connections."""


class SQLiteIdempotency(IdempotencyStore):
    def __init__(self, path: Path, *, clock: Any = time.time, limits: Limits = DEFAULT_LIMITS) -> None:
        self._clock = clock
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idempotency")
        self._conn = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(SCHEMA)
        migrate_sqlite(self._conn)
        self._claims = 0

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._begin, tenant, key, fingerprint, owner, lease_s)
        except sqlite3.Error as exc:
            if (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF not in _SQLITE_UNAVAILABLE:
                raise
            raise LedgerUnavailable(f"the idempotency records cannot be written now: {exc}") from exc

    def _begin(self, tenant: str, key: str, fingerprint: str, owner: str, lease_s: float) -> Begun:
        now = self._clock()
        conn = self._conn
        # a stored answer is read without the database's write lock (a done record changes only when it expires),
        # and decoded after: replays of a large answer must not hold up the ledger's commits
        found = conn.execute(_SELECT, (tenant, key)).fetchone()
        if found is not None and found[1] == "done" and found[3] > now:
            return _decoded(found[2]) if found[0] == fingerprint else Mismatch()
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
            if conn.in_transaction:  # SQLite may have rolled it back itself (a full disk, an I/O error)
                conn.execute("ROLLBACK")
            raise
        return _decoded(begun) if isinstance(begun, str) else begun

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
        text, size = _encoded(answer)
        if size > self.limits.answer_bytes:  # not kept: the claim is given up with the row
            return (("DELETE FROM idempotency WHERE tenant = ? AND key = ? AND owner = ? AND state = 'running'",
                     (claim.tenant, claim.key, claim.owner)),)
        return (("UPDATE idempotency SET state = 'done', answer = ?, size = ?, expires = ? WHERE tenant = ? AND "
                 "key = ? AND owner = ?", (text, size, self._clock() + ttl_s, claim.tenant, claim.key,
                                           claim.owner)),)

    async def abandon(self, claim: Claim) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._abandon, claim)

    def _abandon(self, claim: Claim) -> None:
        self._conn.execute("DELETE FROM idempotency WHERE tenant = ? AND key = ? AND owner = ? AND state = "
                           "'running'", (claim.tenant, claim.key, claim.owner))

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._conn.close()


# a claim in one statement (a CASE's branches run in order): a live key is not claimed; an expired one is taken over
# (the tenant holds as many records after: no room needed), its row locked first and read at its newest (still
# expired?); for a new key, the tenant's totals row is locked (read at its newest) and checked, one row however many
# records it holds (quotas/idempotency_totals.py); no totals row yet is no room (see _PG_ROOM). Each path takes the
# record's lock before the totals', as a stored answer's update does (its trigger), or only the totals': no deadlock.
# Then what the key holds, if not claimed
_PG_BEGIN = """
WITH claimed AS (
    INSERT INTO idempotency
    SELECT %(tenant)s, %(key)s, %(fp)s, %(owner)s, 'running', NULL, %(expires)s
    WHERE CASE WHEN EXISTS (SELECT 1 FROM idempotency WHERE tenant = %(tenant)s AND key = %(key)s
                                                        AND expires > %(now)s) THEN false
          WHEN EXISTS (SELECT 1 FROM idempotency WHERE tenant = %(tenant)s AND key = %(key)s)
               THEN (SELECT expires <= %(now)s FROM idempotency WHERE tenant = %(tenant)s AND key = %(key)s FOR UPDATE)
          ELSE (SELECT records < %(records)s AND bytes < %(bytes)s FROM idempotency_tenants
                WHERE tenant = %(tenant)s FOR UPDATE) END
    ON CONFLICT (tenant, key) DO UPDATE
        SET fingerprint = excluded.fingerprint, owner = excluded.owner, state = 'running', answer = NULL,
            expires = excluded.expires
        WHERE idempotency.expires <= %(now)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM claimed), i.fingerprint, i.owner, i.state, i.answer, i.expires
FROM (SELECT 1) AS one LEFT JOIN idempotency AS i ON i.tenant = %(tenant)s AND i.key = %(key)s
"""
# run only when a new key was not claimed: the tenant's totals row made (its first claim), its expired records
# deleted (they count until then; the index on (tenant, expires) finds them), whether it had room as of this
# statement's start (NULL: its totals row was made by a concurrent claim since) and when its first live record expires
_PG_ROOM = """
WITH made AS (INSERT INTO idempotency_tenants VALUES (%(tenant)s, 0, 0) ON CONFLICT (tenant) DO NOTHING RETURNING 1),
     pruned AS (DELETE FROM idempotency WHERE tenant = %(tenant)s AND expires <= %(now)s RETURNING 1)
SELECT (SELECT count(*) FROM made) + (SELECT count(*) FROM pruned),
       (SELECT records < %(records)s AND bytes < %(bytes)s FROM idempotency_tenants WHERE tenant = %(tenant)s),
       (SELECT min(expires) FROM idempotency WHERE tenant = %(tenant)s AND expires > %(now)s)
"""
# every tenant's expired records, their totals rows locked first (in tenant order) as a group commit locks them
# before the records it updates: a prune that locked a record first, then waited for its tenant's totals row held by
# a commit that waited for that record, deadlocked (found in review)
PG_PRUNE = """
WITH expired AS (SELECT DISTINCT tenant FROM idempotency WHERE expires <= %(now)s),
     locked AS (SELECT t.tenant FROM idempotency_tenants AS t JOIN expired USING (tenant)
                ORDER BY t.tenant COLLATE "C" FOR UPDATE OF t)
DELETE FROM idempotency WHERE expires <= %(now)s AND tenant IN (SELECT tenant FROM locked)
"""
CLAIM_TRIES = 3  # claim statements a begin runs at most (room made or freed, or a key claimed concurrently: again)
SENDS = 2  # a statement's sends at most, when the database failed it for now (its reply lost, a deadlock)
RESEND_DELAY_S = 0.05
GIVE_UP_DELAYS_S = (0.05, 5.0)  # between rounds of owed give-ups: the first, the most (under the gateway's 10 s wait)
MAX_GIVE_UPS = 10_000  # claims owed a give-up at most
GIVE_UP_FOR_S = 900.0  # how long an abandon the database refused is owed (longer than the gateway's lease, 600 s)
_PG_FINISH = ("UPDATE idempotency SET state = 'done', answer = %s, expires = %s WHERE tenant = %s AND key = %s "
              "AND owner = %s")
_PG_ABANDON = "DELETE FROM idempotency WHERE tenant = %s AND key = %s AND owner = %s AND state = 'running'"


class PostgresIdempotency(IdempotencyStore):
    """Records in the fleet database at `url`, the same one the `PostgresLedger` writes (its migrations)."""

    def __init__(self, url: str, *, clock: Any = time.time, max_connections: int = 10,
                 timeout_s: float = 5.0, limits: Limits = DEFAULT_LIMITS) -> None:
        import psycopg
        from psycopg_pool import AsyncConnectionPool, PoolTimeout

        from quotas.fleet_db import CONNECT_TIMEOUT_S
        from quotas.ledger_postgres import open_schema

        open_schema(url)
        self._clock = clock
        self.limits = limits
        self._errors, self._no_connection = psycopg.Error, PoolTimeout
        self._pool = AsyncConnectionPool(url, min_size=1, max_size=max_connections, open=False, timeout=timeout_s,
                                         kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                                         check=AsyncConnectionPool.check_connection, name="idempotency")
        self._opened = False
        self._claims = 0
        self._give_ups: dict[tuple[str, str, str], float] = {}  # (tenant, key, owner): until when (time.monotonic())
        self._worker: asyncio.Task[None] | None = None

    async def _run(self, sql: str, args: Any, *, sends: int = SENDS) -> Any:
        """One statement on a pooled connection, sent again if the database failed it for now (every statement here
        is idempotent for its request); still failing, a retryable 503 (`NotSent` if it never reached a connection)."""
        if not self._opened:  # the pool belongs to the loop that first uses it (the gateway's)
            self._opened = True
            await self._pool.open()
        sent = False
        for i in range(sends):
            try:
                async with self._pool.connection() as conn:
                    sent = True
                    cur = await conn.execute(sql, args)
                    return await cur.fetchone() if cur.description else None
            except self._errors as exc:
                if not _pg_unavailable(exc):
                    raise
                # no connection within the pool's timeout: waiting as long again would not help
                if i == sends - 1 or isinstance(exc, self._no_connection):
                    why = f"the idempotency records cannot be reached: {exc}"
                    raise (LedgerUnavailable(why) if sent else NotSent(why)) from exc
            await asyncio.sleep(RESEND_DELAY_S)
        raise AssertionError("unreachable")

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        now = self._clock()
        args = {"tenant": tenant, "key": key, "fp": fingerprint, "owner": owner, "expires": now + lease_s, "now": now,
                "records": self.limits.records, "bytes": self.limits.bytes}
        self._claims += 1
        if self._claims % PRUNE_EVERY == 0:
            await self._run(PG_PRUNE, {"now": now})
        try:
            for _ in range(CLAIM_TRIES):
                claimed, found_fp, found_owner, state, answer, expires = await self._run(_PG_BEGIN, args)
                if claimed:
                    return Claim(tenant, key, fingerprint, owner)
                if found_fp is not None and expires > now:
                    if found_fp != fingerprint:
                        return Mismatch()
                    if state == "running" and found_owner == owner:  # made by a send whose reply was lost
                        return Claim(tenant, key, fingerprint, owner)
                    return _decoded(answer) if state == "done" else Running()
                # no room (or no totals row yet), or the key claimed by another request since the statement's snapshot
                changed, room, first = await self._run(_PG_ROOM, args)
                if not changed and room is False:
                    return _full(now, first)
        except NotSent:
            raise
        except LedgerUnavailable:  # a claim statement may have committed: this request will not run it
            self._give_up_later((tenant, key, owner), lease_s)
            raise
        return Running() if room else _full(now, first)  # each try's room taken by claims at once: the key's too

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        text, size = _encoded(answer)
        if size > self.limits.answer_bytes:  # not kept: the claim is given up with the row
            return ((_PG_ABANDON, (claim.tenant, claim.key, claim.owner)),)
        return ((_PG_FINISH, (text, self._clock() + ttl_s, claim.tenant, claim.key, claim.owner)),)

    async def abandon(self, claim: Claim) -> None:
        try:
            await self._run(_PG_ABANDON, (claim.tenant, claim.key, claim.owner))
        except LedgerUnavailable:  # until it lands a retry waits (409), then runs
            self._give_up_later((claim.tenant, claim.key, claim.owner), GIVE_UP_FOR_S)

    def _give_up_later(self, at: tuple[str, str, str], for_s: float) -> None:
        """Owe the give-up of `at`'s running claim (tenant, key, owner), if any, for `for_s` (only that request's, which
        will not run: no other request's claim or answer is touched)."""
        if at not in self._give_ups and len(self._give_ups) >= MAX_GIVE_UPS:
            log.error("too many idempotency claims owed a give-up: key %r (tenant %s) stays claimed until its lease "
                      "ends", at[1], at[0])
            return
        self._give_ups[at] = time.monotonic() + for_s
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._give_up())

    async def _give_up(self) -> None:
        """Delete the owed claims, oldest first; a round stops at the first failure and the next waits longer."""
        delay = GIVE_UP_DELAYS_S[0]
        while self._give_ups:
            for at, until in list(self._give_ups.items()):
                if until > time.monotonic():
                    try:
                        await self._run(_PG_ABANDON, at)
                    except LedgerUnavailable:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, GIVE_UP_DELAYS_S[1])
                        break
                if self._give_ups.get(at) == until:
                    del self._give_ups[at]
            else:
                delay = GIVE_UP_DELAYS_S[0]

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._give_ups:
            log.error("closing with %d idempotency claims owed a give-up: their keys stay claimed until their "
                      "leases end", len(self._give_ups))
        await self._pool.close()


class NotSent(LedgerUnavailable):
    """No connection to the database was had in time: the statement was not sent (nothing was claimed)."""


def _pg_unavailable(exc: BaseException) -> bool:
    """The database failing for now, not a bug in our SQL: the connection lost or not had in time, a deadlock or
    serialization failure, a lock or statement timeout, a shutdown, no disk (psycopg's OperationalError: SQLSTATE
    classes 08, 40, 53, 55, 57, 58), or a read-only server (25006: a standby, or a primary demoted by a failover)."""
    import psycopg

    return isinstance(exc, psycopg.OperationalError) or getattr(exc, "sqlstate", None) == "25006"


def _decoded(stored: str | bytes) -> Replay:
    """A stored answer to replay (msgspec: several times json.loads' speed on megabytes of logprobs)."""
    return Replay(msgspec.json.decode(stored))


def _encoded(answer: dict[str, Any]) -> tuple[str, int]:
    """The answer as JSON text and its size in bytes (UTF-8), on the event loop: msgspec's encoder (Litestar's
    own), several times json.dumps' speed on an answer with logprobs (megabytes at 20 alternatives a token), the
    same value read back."""
    encoded = msgspec.json.encode(answer)
    return encoded.decode(), len(encoded)
