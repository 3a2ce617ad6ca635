"""Idempotency-Key records in the fleet database (`PostgresIdempotency`): the table SQLite has, beside the ledger's
tables (quotas/idempotency.py has the records, the interface and the bounds). A claim is one statement on a connection
of the async pool, and the `done` record commits with the ledger row, as in SQLite, so any replica replays an answer
whose row any replica wrote. A tenant's new keys are counted in its totals row, kept by triggers, which a claim of a
new key locks while it checks and inserts (quotas/idempotency_totals.py).

A claim the database cannot take now is `LedgerUnavailable` (a retryable 503 at the gateway, before anything is
counted, charged or run): its connection lost or not had in time, a deadlock, a lock or statement timeout, a shutdown,
a read-only server (a failover). A bug (an SQL error, another error code) is still raised as it is. A statement the
server refused with an error was rolled back, and one never sent (no connection in time) did not run: either is a 503
at once (`NotRun`), not sent again (it would mostly wait as long for the same answer), and nothing is owed a give-up.
Only a claim whose reply was lost may have committed: it is sent again at once, and a running record of the same
request (its owner, a request id no other request has) is its claim; if that fails too, the record it may have made is
given up in the background once the database answers (quotas/idempotency_give_ups.py), so the client's retry is not
told 409 for the lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from quotas.idempotency import (
    DEFAULT_LIMITS,
    PRUNE_EVERY,
    Begun,
    Claim,
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
from quotas.ledger import LedgerUnavailable, Statement

# now, by the database's clock (the statement's start: one instant however often a statement reads it), never by the
# replica's: each replica's own clock judged another's lease, and one whose clock ran ahead (650 s, found in review)
# took over a claim still running, whose owner's answer then matched no record: both ran and both were billed. Redis
# and SQLite had one clock already (Redis's own, the one host's). `shift` moves it, for tests that move time
NOW = "(extract(epoch from statement_timestamp())::float8 + %(shift)s)"
_NOW = NOW.replace("%(shift)s", "%s")  # in a statement with positional parameters
# a claim in one statement (a CASE's branches run in order): a live key is not claimed; an expired one is taken over
# (the tenant holds as many records after: no room needed), its row locked first and read at its newest (still
# expired?); for a new key, the tenant's totals row is locked (read at its newest) and checked, one row however many
# records it holds (quotas/idempotency_totals.py); no totals row yet is no room (see _PG_ROOM). Each path takes the
# record's lock before the totals', as a stored answer's update does (its trigger), or only the totals': no deadlock.
# Then what the key holds, if not claimed
_PG_BEGIN = f"""
WITH claimed AS (
    INSERT INTO idempotency
    SELECT %(tenant)s, %(key)s, %(fp)s, %(owner)s, 'running', NULL, {NOW} + %(lease)s
    WHERE CASE WHEN EXISTS (SELECT 1 FROM idempotency WHERE tenant = %(tenant)s AND key = %(key)s
                                                        AND expires > {NOW}) THEN false
          WHEN EXISTS (SELECT 1 FROM idempotency WHERE tenant = %(tenant)s AND key = %(key)s)
               THEN (SELECT expires <= {NOW} FROM idempotency WHERE tenant = %(tenant)s AND key = %(key)s FOR UPDATE)
          ELSE (SELECT records < %(records)s AND bytes < %(bytes)s FROM idempotency_tenants
                WHERE tenant = %(tenant)s FOR UPDATE) END
    ON CONFLICT (tenant, key) DO UPDATE
        SET fingerprint = excluded.fingerprint, owner = excluded.owner, state = 'running', answer = NULL,
            expires = excluded.expires
        WHERE idempotency.expires <= {NOW}
    RETURNING 1
)
SELECT (SELECT count(*) FROM claimed), i.fingerprint, i.owner, i.state, i.answer, i.expires, {NOW}
FROM (SELECT 1) AS one LEFT JOIN idempotency AS i ON i.tenant = %(tenant)s AND i.key = %(key)s
"""
# run only when a new key was not claimed: the tenant's totals row made (its first claim), its expired records
# deleted (they count until then; the index on (tenant, expires) finds them), whether it had room as of this
# statement's start (NULL: its totals row was made by a concurrent claim since), when its first live record expires
# and now
_PG_ROOM = f"""
WITH made AS (INSERT INTO idempotency_tenants VALUES (%(tenant)s, 0, 0) ON CONFLICT (tenant) DO NOTHING RETURNING 1),
     pruned AS (DELETE FROM idempotency WHERE tenant = %(tenant)s AND expires <= {NOW} RETURNING 1)
SELECT (SELECT count(*) FROM made) + (SELECT count(*) FROM pruned),
       (SELECT records < %(records)s AND bytes < %(bytes)s FROM idempotency_tenants WHERE tenant = %(tenant)s),
       (SELECT min(expires) FROM idempotency WHERE tenant = %(tenant)s AND expires > {NOW}), {NOW}
"""
# every tenant's expired records, their totals rows locked first (in tenant order) as a group commit locks them
# before the records it updates: a prune that locked a record first, then waited for its tenant's totals row held by
# a commit that waited for that record, deadlocked (found in review)
PG_PRUNE = f"""
WITH expired AS (SELECT DISTINCT tenant FROM idempotency WHERE expires <= {NOW}),
     locked AS (SELECT t.tenant FROM idempotency_tenants AS t JOIN expired USING (tenant)
                ORDER BY t.tenant COLLATE "C" FOR UPDATE OF t)
DELETE FROM idempotency WHERE expires <= {NOW} AND tenant IN (SELECT tenant FROM locked)
"""
CLAIM_TRIES = 3  # claim statements a begin runs at most (room made or freed, or a key claimed concurrently: again)
SENDS = 2  # a statement's sends at most, when its reply was lost
RESEND_DELAY_S = 0.05
# the database's clock (shift, TTL), tenant, key, owner
_PG_FINISH = (f"UPDATE idempotency SET state = 'done', answer = %s, expires = {_NOW} + %s WHERE tenant = %s "
              "AND key = %s AND owner = %s")
_PG_RENEW = (f"UPDATE idempotency SET expires = {_NOW} + %s WHERE tenant = %s AND key = %s AND owner = %s "
             "AND state = 'running' RETURNING 1")
_PG_STORED = (f"SELECT fingerprint, answer FROM idempotency WHERE tenant = %s AND key = %s AND state = 'done' "
              f"AND expires > {_NOW}")
_PG_ABANDON = "DELETE FROM idempotency WHERE tenant = %s AND key = %s AND owner = %s AND state = 'running'"


class PostgresIdempotency(IdempotencyStore):
    """Records in the fleet database at `url`, the same one the `PostgresLedger` writes (its migrations)."""

    def __init__(self, url: str, *, shift: Callable[[], float] = lambda: 0.0, max_connections: int = 10,
                 timeout_s: float = 5.0, limits: Limits = DEFAULT_LIMITS) -> None:
        import psycopg
        from psycopg_pool import AsyncConnectionPool

        from quotas.fleet_db import CONNECT_TIMEOUT_S, bound_statements
        from quotas.ledger_postgres import open_schema

        open_schema(url)
        self._shift = shift  # seconds added to the database's clock (tests move time with it): see NOW
        self.limits = limits
        self._errors = psycopg.Error
        bound = bound_statements(timeout_s)  # a claim waiting on a lock is a 503 after as long as one for a connection

        async def configure(conn: Any) -> None:
            await conn.execute(bound)

        self._pool = AsyncConnectionPool(url, min_size=1, max_size=max_connections, open=False, timeout=timeout_s,
                                         kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                                         configure=configure, check=AsyncConnectionPool.check_connection,
                                         name="idempotency")
        self._opened = False
        self._claims = 0
        self._give_ups = GiveUps(self._abandon_at)  # claims this replica's requests will not run, deleted once it can

    async def _run(self, sql: str, args: Any, *, sends: int = SENDS) -> Any:
        """One statement on a pooled connection, sent again if its reply was lost (every statement here is idempotent
        for its request); failing for now, a retryable 503: `NotRun` if no send can have committed."""
        if not self._opened:  # the pool belongs to the loop that first uses it (the gateway's)
            self._opened = True
            await self._pool.open()
        lost = False  # a send whose reply was lost: it may have committed
        for i in range(sends):
            sent = False
            try:
                async with self._pool.connection() as conn:
                    sent = True
                    cur = await conn.execute(sql, args)
                    return await cur.fetchone() if cur.description else None
            except self._errors as exc:
                if not _pg_unavailable(exc):
                    raise
                # sent again only when its reply was lost: one never sent (no connection within the pool's timeout)
                # would wait as long again, and one the server refused (a statement or lock timeout, a read-only
                # server) would mostly get the same answer (a statement timeout took twice as long); a deadlock, which
                # the statements here avoid by locking in one order, is left to the client's retry
                refused = _pg_refused(exc)
                lost = lost or (sent and not refused)
                if i == sends - 1 or not sent or refused:
                    why = f"the idempotency records cannot be reached: {exc}"
                    raise (LedgerUnavailable(why) if lost else NotRun(why)) from exc
            await asyncio.sleep(RESEND_DELAY_S)
        raise AssertionError("unreachable")

    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        args = {"tenant": tenant, "key": key, "fp": fingerprint, "owner": owner, "lease": lease_s,
                "shift": self._shift(), "records": self.limits.records, "bytes": self.limits.bytes}
        self._claims += 1
        if self._claims % PRUNE_EVERY == 0:
            await self._run(PG_PRUNE, args)
        try:
            for _ in range(CLAIM_TRIES):
                claimed, found_fp, found_owner, state, answer, expires, now = await self._run(_PG_BEGIN, args)
                if claimed:
                    return Claim(tenant, key, fingerprint, owner)
                if found_fp is not None and expires > now:
                    if found_fp != fingerprint:
                        return Mismatch()
                    if state == "running" and found_owner == owner:  # made by a send whose reply was lost
                        return Claim(tenant, key, fingerprint, owner)
                    return _decoded(answer) if state == "done" else Running()
                # no room (or no totals row yet), or the key claimed by another request since the statement's snapshot
                changed, room, first, now = await self._run(_PG_ROOM, args)
                if not changed and room is False:
                    return _full(now, first)
        except NotRun:
            raise
        except LedgerUnavailable:  # a claim statement may have committed: this request will not run it
            self._give_ups.owe((tenant, key, owner), lease_s)
            raise
        return Running() if room else _full(now, first)  # each try's room taken by claims at once: the key's too

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        text, _ = _kept(answer, self.limits)
        return ((_PG_FINISH, (text, self._shift(), ttl_s, claim.tenant, claim.key, claim.owner)),)

    async def finish_alone(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        for sql, args in self.finish_with_row(claim, answer, ttl_s):
            await self._run(sql, args)

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """Its lease extended (the statement changes no size: the totals' trigger locks nothing)."""
        args = (self._shift(), lease_s, claim.tenant, claim.key, claim.owner)
        return await self._run(_PG_RENEW, args) is not None

    async def stored(self, tenant: str, key: str, fingerprint: str) -> Replay | Mismatch | None:
        found = await self._run(_PG_STORED, (tenant, key, self._shift()))
        if found is None:
            return None
        return _decoded(found[1]) if found[0] == fingerprint else Mismatch()

    async def abandon(self, claim: Claim) -> None:
        try:
            await self._run(_PG_ABANDON, (claim.tenant, claim.key, claim.owner))
        except LedgerUnavailable:  # until it lands a retry waits (409), then runs
            self._give_ups.owe((claim.tenant, claim.key, claim.owner), GIVE_UP_FOR_S)

    async def _abandon_at(self, at: At) -> None:
        await self._run(_PG_ABANDON, at)

    async def close(self) -> None:
        await self._give_ups.close()
        await self._pool.close()


class NotRun(LedgerUnavailable):
    """The statement did not commit (nothing was claimed): no connection was had in time, so it was not sent, or the
    server refused it."""


def _pg_unavailable(exc: BaseException) -> bool:
    """The database failing for now, not a bug in our SQL: the connection lost or not had in time, a deadlock or
    serialization failure, a lock or statement timeout, a shutdown, no disk (psycopg's OperationalError: SQLSTATE
    classes 08, 40, 53, 55, 57, 58), or a read-only server (25006: a standby, or a primary demoted by a failover)."""
    import psycopg

    return isinstance(exc, psycopg.OperationalError) or getattr(exc, "sqlstate", None) == "25006"


def _pg_refused(exc: BaseException) -> bool:
    """The server answered the statement with an error (severity ERROR): the statement's own transaction (autocommit)
    was rolled back, so it did not commit; an error past the commit is a PANIC in PostgreSQL, never an ERROR. Anything
    else (the connection lost, a FATAL that ends it) may have come after the commit: its reply was lost."""
    diag = getattr(exc, "diag", None)
    return getattr(exc, "sqlstate", None) is not None and getattr(diag, "severity_nonlocalized", None) == "ERROR"
