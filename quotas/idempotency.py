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
- `RedisIdempotency` (replicas): the record in Redis, claimed and finished by Lua scripts, so a replica that
  did not serve the first request replays it too.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from quotas.ledger import LedgerUnavailable, Statement

SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    owner TEXT NOT NULL,
    state TEXT NOT NULL,
    answer TEXT,
    expires REAL NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expires ON idempotency(expires);
"""
PRUNE_EVERY = 1000  # claims between deletions of expired records
_SELECT = "SELECT fingerprint, state, answer, expires FROM idempotency WHERE tenant = ? AND key = ?"


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


Begun = Claim | Replay | Running | Mismatch


class IdempotencyStore(ABC):
    @abstractmethod
    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        """Claim `key` for `owner`, or say why not (its answer, still running, another body)."""

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
    def __init__(self, path: Path, *, clock: Any = time.time) -> None:
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idempotency")
        self._conn = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(SCHEMA)
        self._claims = 0

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._begin, tenant, key, fingerprint, owner, lease_s)

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
                conn.execute("INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?, 'running', NULL, ?)",
                             (tenant, key, fingerprint, owner, now + lease_s))
                begun: Begun | str = Claim(tenant, key, fingerprint, owner)
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
            conn.execute("ROLLBACK")
            raise
        return _decoded(begun) if isinstance(begun, str) else begun

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        return (("UPDATE idempotency SET state = 'done', answer = ?, expires = ? WHERE tenant = ? AND key = ? "
                 "AND owner = ?", (_encode(answer), self._clock() + ttl_s, claim.tenant, claim.key,
                                   claim.owner)),)

    async def abandon(self, claim: Claim) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._abandon, claim)

    def _abandon(self, claim: Claim) -> None:
        self._conn.execute("DELETE FROM idempotency WHERE tenant = ? AND key = ? AND owner = ? AND state = "
                           "'running'", (claim.tenant, claim.key, claim.owner))

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._conn.close()


# a claim in one statement: insert, or take over an expired record; then what the key holds, if not claimed
_PG_BEGIN = """
WITH claimed AS (
    INSERT INTO idempotency VALUES (%(tenant)s, %(key)s, %(fp)s, %(owner)s, 'running', NULL, %(expires)s)
    ON CONFLICT (tenant, key) DO UPDATE
        SET fingerprint = excluded.fingerprint, owner = excluded.owner, state = 'running', answer = NULL,
            expires = excluded.expires
        WHERE idempotency.expires <= %(now)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM claimed), i.fingerprint, i.state, i.answer
FROM (SELECT 1) AS one LEFT JOIN idempotency AS i ON i.tenant = %(tenant)s AND i.key = %(key)s
"""
_PG_FINISH = ("UPDATE idempotency SET state = 'done', answer = %s, expires = %s WHERE tenant = %s AND key = %s "
              "AND owner = %s")


class PostgresIdempotency(IdempotencyStore):
    """Records in the fleet database at `url`, the same one the `PostgresLedger` writes (its migrations)."""

    def __init__(self, url: str, *, clock: Any = time.time, max_connections: int = 10,
                 timeout_s: float = 5.0) -> None:
        import psycopg
        from psycopg_pool import AsyncConnectionPool, PoolTimeout

        from quotas.fleet_db import CONNECT_TIMEOUT_S
        from quotas.ledger_postgres import open_schema

        open_schema(url)
        self._clock = clock
        self._unreachable = (psycopg.OperationalError, PoolTimeout)
        self._pool = AsyncConnectionPool(url, min_size=1, max_size=max_connections, open=False, timeout=timeout_s,
                                         kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                                         check=AsyncConnectionPool.check_connection, name="idempotency")
        self._opened = False
        self._claims = 0

    async def _run(self, sql: str, args: Any) -> Any:
        """One statement on a pooled connection; the database being unreachable is a retryable 503."""
        if not self._opened:  # the pool belongs to the loop that first uses it (the gateway's)
            self._opened = True
            await self._pool.open()
        try:
            async with self._pool.connection() as conn:
                cur = await conn.execute(sql, args)
                return await cur.fetchone() if cur.description else None
        except self._unreachable as exc:
            raise LedgerUnavailable(f"the idempotency records cannot be reached: {exc}") from exc

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        now = self._clock()
        claimed, found_fp, state, answer = await self._run(_PG_BEGIN, {
            "tenant": tenant, "key": key, "fp": fingerprint, "owner": owner, "expires": now + lease_s, "now": now})
        self._claims += 1
        if self._claims % PRUNE_EVERY == 0:
            await self._run("DELETE FROM idempotency WHERE expires <= %s", (now,))
        if claimed:
            return Claim(tenant, key, fingerprint, owner)
        if found_fp is None:  # claimed by another request since this statement's snapshot, or just abandoned
            return Running()
        if found_fp != fingerprint:
            return Mismatch()
        return _decoded(answer) if state == "done" else Running()

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        return ((_PG_FINISH, (_encode(answer), self._clock() + ttl_s, claim.tenant, claim.key, claim.owner)),)

    async def abandon(self, claim: Claim) -> None:
        await self._run("DELETE FROM idempotency WHERE tenant = %s AND key = %s AND owner = %s AND state = 'running'",
                        (claim.tenant, claim.key, claim.owner))

    async def close(self) -> None:
        await self._pool.close()


_BEGIN = """
local found = redis.call('GET', KEYS[1])
if not found then
  redis.call('SET', KEYS[1], cjson.encode({state = 'running', fp = ARGV[1], owner = ARGV[2]}), 'PX', ARGV[3])
  return {'claim'}
end
local rec = cjson.decode(found)
if rec.fp ~= ARGV[1] then return {'mismatch'} end
if rec.state == 'done' then return {'replay', rec.answer} end
return {'running'}
"""
_FINISH = """
local found = redis.call('GET', KEYS[1])
if found and cjson.decode(found).owner == ARGV[2] then
  redis.call('SET', KEYS[1], cjson.encode({state = 'done', fp = ARGV[1], owner = ARGV[2], answer = ARGV[3]}),
             'PX', ARGV[4])
end
return 1
"""
_ABANDON = """
local found = redis.call('GET', KEYS[1])
if found then
  local rec = cjson.decode(found)
  if rec.owner == ARGV[1] and rec.state == 'running' then redis.call('DEL', KEYS[1]) end
end
return 1
"""


class RedisIdempotency(IdempotencyStore):
    def __init__(self, url: str, *, timeout_s: float = 1.0) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._begin = self._redis.register_script(_BEGIN)
        self._finish = self._redis.register_script(_FINISH)
        self._abandon = self._redis.register_script(_ABANDON)

    @staticmethod
    def _key(tenant: str, key: str) -> str:
        return f"tg:idem:{tenant}:{key}"

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        got = await self._begin(keys=[self._key(tenant, key)], args=[fingerprint, owner, int(lease_s * 1000)])
        kind = got[0].decode() if isinstance(got[0], bytes) else got[0]
        if kind == "claim":
            return Claim(tenant, key, fingerprint, owner)
        if kind == "replay":
            return _decoded(got[1])
        return Mismatch() if kind == "mismatch" else Running()

    async def finish(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        await self._finish(keys=[self._key(claim.tenant, claim.key)],
                           args=[claim.fingerprint, claim.owner, _encode(answer), int(ttl_s * 1000)])

    async def abandon(self, claim: Claim) -> None:
        await self._abandon(keys=[self._key(claim.tenant, claim.key)], args=[claim.owner])

    async def close(self) -> None:
        await self._redis.aclose()


def _decoded(stored: str | bytes) -> Replay:
    """A stored answer to replay (msgspec: several times json.loads' speed on megabytes of logprobs)."""
    return Replay(msgspec.json.decode(stored))


def _encode(answer: dict[str, Any]) -> str:
    """The answer as JSON text, on the event loop: msgspec's encoder (Litestar's own), several times json.dumps'
    speed on an answer with logprobs (megabytes at 20 alternatives a token), the same value read back."""
    return msgspec.json.encode(answer).decode()
