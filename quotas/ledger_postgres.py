"""The usage ledger in the fleet's PostgreSQL: every replica's rows and refusal counts in one place.

The writer is quotas/ledger.py's, as for SQLite: one thread per replica with a synchronous connection,
taking up to GROUP_MAX queued rows per transaction and sending them in one pipeline (psycopg's pipeline mode:
the rows, their idempotency records and the refusal counts go out together and the commit is one round
trip). One thread with a synchronous connection rather than the async pool: group commit already makes one
commit per group, not per request, so the event loop never waits on PostgreSQL, only on its row's future,
and the writer's loop, retries and backoff stay the ones SQLite's ledger has, with its promises (a refusal
count is durable no later than the next row; rows become durable in the order they were queued). A second
writer thread would overlap two commits' WAL flushes, but would break both promises. A commit returns once
PostgreSQL has made it durable as its `synchronous_commit` says (on by default: the WAL is flushed to disk),
so an answer's row survives a killed gateway and a crashed database. A commit whose reply was lost (the
connection cut after the server committed) is not sent again blind: the next connection asks the server what
became of its transaction (`pg_xact_status` of the id read before its COMMIT), and what it wrote is not written
again (each row would be refused as a duplicate of itself, its refusal counts added twice).

Reads (reports, the dashboard, the reaper's billing look-ups) take a connection from a small pool. Reports sum
in SQL: money is NUMERIC here, so its sums are exact where they are taken; `PostgresReader` reads the same
tables read-only on a connection of its own (a report's process, quotas/report_worker.py). A read's statement runs
at most READ_TIMEOUT_S (60 s). Reads under `lock_bounded_reads` (a re-seed of a Redis that lost a tenant's counters,
quotas/seed.py: a request waits on it) also wait for another session's lock on a table (an operator's LOCK TABLE, an
ALTER) at most `read_lock_timeout_s` (TIERGATE_LEDGER_READ_LOCK_TIMEOUT_S, READ_LOCK_TIMEOUT_S), then raise
`LedgerReadLocked`: `SET lock_timeout` on the pooled connection for that read, `RESET` before it goes back. Writes
(the writer's commits, `record_now`, `mark_fallback_applied`) and idempotency claims never get it: they wait on real
row locks by design.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool

from quotas.fleet_db import (
    CONNECT_TIMEOUT_S,
    ConcurrentIndex,
    Migration,
    bound_statements,
    bounded,
    connect,
    fault_name,
    is_db_fault,
    migrate,
    pg,
)
from quotas.idempotency_totals import IDEMPOTENCY_TOTALS
from quotas.ledger import Ledger, LedgerReadLocked, Pending, Statement, log
from quotas.ledger_reads import READ_TIMEOUT_S, LedgerReads, Reader, ReadSource
from quotas.ledger_rows import CARRY_PENDING, COLUMNS, CountKey, LedgerRow, Refusal, RequestTotals, count_key, to_db

COMPONENT = "ledger"
READ_LOCK_TIMEOUT_S = 0.5  # a lock-bounded read's wait for another session's table lock (the setting's default)
# the ledger's tables, one migration each release that changed them; 1 is the schema of the release before the
# fleet store (the SQLite tables of quotas/ledger_rows.py), 2 adds the Idempotency-Key records, 3 the version of
# the tier that answered, 4 an index to find one tenant's refusal counts (a report read every tenant's), 5 each
# tenant's idempotency totals (records and stored bytes), kept by triggers and counted once for the rows there,
# 6 the mark of rows settled on a quota fallback and which of them Redis' counters have (quotas/ledger_rows.py
# FALLBACK_SCHEMA), 7 the index that finds the others (built concurrently), 8 the list of those still pending, kept by
# triggers (quotas/ledger_rows.py FALLBACK_PENDING), with the marked rows not yet applied carried over
MIGRATIONS: list[Migration] = [
    """
    CREATE TABLE requests (
        request_id TEXT PRIMARY KEY,
        ts DOUBLE PRECISION NOT NULL,
        tenant TEXT NOT NULL,
        key_id TEXT NOT NULL,
        tier TEXT,
        model TEXT,
        status TEXT NOT NULL,
        http_status INTEGER NOT NULL,
        input_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        price_usd NUMERIC NOT NULL,
        compute_cost_usd NUMERIC NOT NULL,
        cost_basis TEXT NOT NULL,
        ttft_s DOUBLE PRECISION,
        total_s DOUBLE PRECISION NOT NULL,
        finish_reason TEXT,
        error_code TEXT,
        route_reason TEXT,
        degrade_level INTEGER NOT NULL DEFAULT 0,
        degrade_actions TEXT,
        requested_tier TEXT,
        route_saving_usd NUMERIC NOT NULL DEFAULT 0,
        cache_status TEXT,
        cache_saving_usd NUMERIC NOT NULL DEFAULT 0,
        cascade_of TEXT
    );
    CREATE TABLE refusal_counts (
        minute BIGINT NOT NULL,
        tenant TEXT NOT NULL,
        key_id TEXT NOT NULL,
        reason TEXT NOT NULL,
        http_status INTEGER NOT NULL,
        count BIGINT NOT NULL,
        PRIMARY KEY (minute, tenant, key_id, reason, http_status)
    );
    CREATE INDEX requests_tenant_ts ON requests(tenant, ts);
    CREATE INDEX requests_ts ON requests(ts);
    """,
    """
    CREATE TABLE idempotency (
        tenant TEXT NOT NULL,
        key TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        owner TEXT NOT NULL,
        state TEXT NOT NULL,
        answer TEXT,
        expires DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (tenant, key)
    );
    CREATE INDEX idempotency_expires ON idempotency(expires);
    """,
    """
    ALTER TABLE requests ADD COLUMN model_version TEXT;
    """,
    # built concurrently: refusal counts are written on the hot path, and a long table's index takes a while
    ConcurrentIndex("refusal_counts_tenant_minute", "refusal_counts(tenant, minute)"),
    f"""
    CREATE TABLE idempotency_tenants (
        tenant TEXT PRIMARY KEY,
        records BIGINT NOT NULL,
        bytes BIGINT NOT NULL
    );
    CREATE INDEX idempotency_tenant_expires ON idempotency(tenant, expires);
    {IDEMPOTENCY_TOTALS}
    INSERT INTO idempotency_tenants
    SELECT tenant, count(*), coalesce(sum(octet_length(answer)), 0) FROM idempotency GROUP BY tenant;
    """,
    """
    ALTER TABLE requests ADD COLUMN fallback TEXT;
    CREATE TABLE fallback_applied (request_id TEXT PRIMARY KEY);
    """,
    ConcurrentIndex("requests_fallback", "requests(ts) WHERE fallback IS NOT NULL"),
    # the triggers first: their locks wait for the writes in flight, so the carry-over sees every row written before
    # them, and every row after them is the triggers'. A row-level trigger whose WHEN fails calls no function: an
    # unmarked row, the hot path's, costs one test
    f"""
    CREATE TABLE fallback_pending (request_id TEXT PRIMARY KEY, ts DOUBLE PRECISION NOT NULL);
    CREATE INDEX fallback_pending_ts ON fallback_pending(ts);
    CREATE FUNCTION tiergate_fallback_marked() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO fallback_pending VALUES (NEW.request_id, NEW.ts) ON CONFLICT DO NOTHING;
        RETURN NULL;
    END $$;
    CREATE TRIGGER fallback_marked AFTER INSERT ON requests FOR EACH ROW WHEN (NEW.fallback IS NOT NULL)
        EXECUTE FUNCTION tiergate_fallback_marked();
    CREATE FUNCTION tiergate_fallback_noted() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM fallback_pending WHERE request_id = NEW.request_id;
        RETURN NULL;
    END $$;
    CREATE TRIGGER fallback_noted AFTER INSERT ON fallback_applied FOR EACH ROW
        EXECUTE FUNCTION tiergate_fallback_noted();
    {CARRY_PENDING};
    """,
]
INSERT = f"INSERT INTO requests({', '.join(COLUMNS)}) VALUES ({', '.join('%s' for _ in COLUMNS)})"
UPSERT_COUNT = ("INSERT INTO refusal_counts VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (minute, tenant, key_id, reason, http_status) "
                "DO UPDATE SET count = refusal_counts.count + excluded.count")
PRUNE = "DELETE FROM refusal_counts WHERE minute < %s"
_XID = "SELECT pg_current_xact_id()::text"  # the group's transaction id (PostgreSQL 13+)
_TENANT = COLUMNS.index("tenant")


def _count_rows(counts: Counter[CountKey]) -> list[tuple[Any, ...]]:
    """Refusal-count upserts in key order: every replica's commit locks the count rows it adds to in one order, so
    two commits adding to the same rows (a tenant refused on two replicas in the same minute) wait for each other
    instead of deadlocking (PostgreSQL then aborts one, and its writer backs off)."""
    return [(*key, n) for key, n in sorted(counts.items())]


def open_schema(url: str, *, upto: int | None = None) -> int:
    """Bring the ledger's tables to this release's version (or to `upto`); returns the version."""
    with connect(url) as conn:
        return migrate(conn, COMPONENT, MIGRATIONS, upto=upto)


class PostgresReads(LedgerReads):
    """PostgreSQL's side of the reads: request totals summed in SQL, per group (NUMERIC sums are exact)."""

    _TS_SECOND = "FLOOR(ts)::BIGINT"

    def _day_start(self, second: str) -> str:
        return f"({second} - MOD(MOD({second}, 86400) + 86400, 86400))"  # no `%`: psycopg's placeholders use it

    def _sum_requests(self, keys: list[str], where: str, args: tuple[Any, ...]) -> list[RequestTotals]:
        n = len(keys)
        group = f" GROUP BY {', '.join(str(i + 1) for i in range(n))}" if keys else ""
        sql = (f"SELECT {''.join(k + ', ' for k in keys)}COUNT(*), SUM(input_tokens), SUM(output_tokens), "
               "SUM(CASE WHEN cache_status = 'hit' THEN 1 ELSE 0 END), SUM(price_usd), SUM(compute_cost_usd), "
               "SUM(cache_saving_usd), SUM(route_saving_usd), SUM(CASE WHEN route_saving_usd > 0 THEN 1 ELSE 0 END) "
               f"FROM requests WHERE {where}{group}")
        return [RequestTotals(tuple(r[:n]), int(r[n]), int(r[n + 1]), int(r[n + 2]), int(r[n + 3]), *r[n + 4:n + 8],
                              int(r[n + 8]))
                for r in self._query(sql, args) if r[n]]  # no GROUP BY: one row, even of no requests


class PostgresLedger(PostgresReads, Ledger):
    """The ledger in the fleet database at `url` (postgresql://…); its tables are migrated on open."""

    COMMIT_IN_DOUBT_AFTER_FAILURE = True  # a COMMIT whose reply was lost may have committed (`_landed` asks)

    def __init__(self, url: str, *, record_timeout_s: float = 10.0, busy_timeout_s: float = 5.0,
                 refusal_retention_days: float = 90.0, max_read_connections: int = 4,
                 read_lock_timeout_s: float = READ_LOCK_TIMEOUT_S) -> None:
        """`busy_timeout_s` bounds how long one commit may wait on a lock (its statement timeout);
        `read_lock_timeout_s` how long a read under `lock_bounded_reads` may (0: its statement timeout)."""
        super().__init__(record_timeout_s=record_timeout_s, busy_timeout_s=busy_timeout_s,
                         refusal_retention_days=refusal_retention_days)
        self.url = url
        self._xid: str | None = None  # the writer's last commit's transaction id, known before its COMMIT was sent
        self.read_lock_timeout_s = read_lock_timeout_s
        self._lock_bounded = threading.local()  # `on`: this thread's reads are under `lock_bounded_reads`
        open_schema(url)
        self._pool = ConnectionPool(url, min_size=1, max_size=max_read_connections, open=True,
                                    kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                                    check=ConnectionPool.check_connection, timeout=record_timeout_s,
                                    configure=bounded(READ_TIMEOUT_S), name="ledger-reads")

    def _connect(self) -> psycopg.Connection[Any]:
        conn = connect(self.url)
        conn.execute(f"SET statement_timeout = {int(self.busy_timeout_s * 1000)}")
        return conn

    def _commit(self, conn: psycopg.Connection[Any], rows: list[Pending], counts: Counter[CountKey], *,
                prune: bool, isolate: bool) -> list[Exception | None]:
        errors: list[Exception | None] = [None] * len(rows)
        # the rows' statements in tenant order: what they change in a tenant's idempotency totals (a trigger's lock
        # on its row, held to the commit) is locked in one order by every replica's group commit, so none deadlock
        order = sorted(range(len(rows)), key=lambda i: rows[i][0][_TENANT])  # code points: COLLATE "C"
        self._xid = None  # known before its COMMIT is sent: asked after, if its reply is lost (`_landed`)
        with conn.transaction(), conn.cursor() as cur, conn.cursor() as xid:
            if isolate:
                self._xid = xid.execute(_XID).fetchone()[0]  # type: ignore[index]
                for i in order:
                    values, _, with_row = rows[i]
                    errors[i] = _isolated(conn, ((INSERT, values), *with_row))
                for key, n in sorted(counts.items()):
                    if (error := _isolated(conn, ((UPSERT_COUNT, (*key, n)),))) is not None:
                        log.error("ledger: refusal count %s dropped: %r", key, error)
            else:
                with conn.pipeline():
                    xid.execute(_XID)
                    cur.executemany(INSERT, [values for values, _, _ in rows])
                    for i in order:
                        for sql, params in rows[i][2]:
                            cur.execute(sql, params)
                    if counts:
                        cur.executemany(UPSERT_COUNT, _count_rows(counts))
                self._xid = xid.fetchone()[0]  # type: ignore[index]
            if prune:
                cur.execute(PRUNE, (self._prune_before(),))
        return errors

    def _landed(self, conn: psycopg.Connection[Any], rows: list[Pending]) -> list[bool] | None:
        """The failed commit's transaction as the server knows it (`pg_xact_status`): committed, its rows found by
        id; aborted (or never sent: no id), None. Still in progress (its backend not yet gone), asked again."""
        if self._xid is None:
            return None
        (status,) = conn.execute("SELECT pg_xact_status(%s::xid8)", (self._xid,)).fetchone()  # type: ignore[misc]
        if status == "in progress":
            raise psycopg.OperationalError("the commit whose reply was lost is still in progress")
        self._xid = None
        if status != "committed":
            return None
        ids = [values[0] for values, _, _ in rows]
        found = {r for (r,) in conn.execute("SELECT request_id FROM requests WHERE request_id = ANY(%s)", (ids,))}
        return [rid in found for rid in ids]

    def _is_db_fault(self, exc: BaseException) -> bool:
        return is_db_fault(exc)

    def _fault_name(self, exc: BaseException) -> str:
        return fault_name(exc)

    def mark_fallback_applied(self, request_ids: Sequence[str]) -> None:
        """Noted in `fallback_applied`, whose trigger takes them off `fallback_pending` in the same commit."""
        with self._pool.connection() as conn, conn.cursor() as cur:  # committed as the pool takes it back
            cur.executemany("INSERT INTO fallback_applied VALUES (%s) ON CONFLICT DO NOTHING",
                            [(rid,) for rid in request_ids])

    def read_source(self) -> ReadSource:
        return ReadSource("postgres", self.url)

    @contextmanager
    def lock_bounded_reads(self) -> Iterator[None]:
        if self.read_lock_timeout_s <= 0:
            yield
            return
        was = getattr(self._lock_bounded, "on", False)
        self._lock_bounded.on = True
        try:
            yield
        finally:
            self._lock_bounded.on = was

    @contextmanager
    def _lock_wait(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """A read on the pooled `conn` (autocommit: a SET outside any transaction holds until RESET): under
        `lock_bounded_reads`, with the lock timeout, lifted again before the connection goes back to the pool."""
        if not getattr(self._lock_bounded, "on", False):
            yield
            return
        conn.execute(f"SET lock_timeout = {max(1, int(self.read_lock_timeout_s * 1000))}")
        try:
            yield
        except pg_errors.LockNotAvailable as exc:
            raise LedgerReadLocked(f"a ledger read waited {self.read_lock_timeout_s:g} s for another session's "
                                   f"lock on the ledger's tables and gave up: {exc}") from exc
        finally:
            if not conn.closed and not conn.broken:
                conn.execute("RESET lock_timeout")

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._pool.connection() as conn, self._lock_wait(conn):
            return conn.execute(pg(sql), args).fetchall()

    def _stream(self, sql: str, args: tuple[Any, ...], size: int) -> Iterator[list[tuple[Any, ...]]]:
        """A server-side cursor (the database holds the result; a batch at a time comes over), in a transaction of
        its own on a pooled connection held until the read ends."""
        with (self._pool.connection() as conn, self._lock_wait(conn), conn.transaction(),
              conn.cursor(name=f"tiergate_read_{uuid.uuid4().hex}") as cur):
            cur.execute(pg(sql), args)
            while batch := cur.fetchmany(size):
                yield batch

    def record_now(self, rows: list[LedgerRow], refusals: Iterable[Refusal] = ()) -> None:
        counts = Counter(count_key(r) for r in refusals)
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            if rows:
                cur.executemany(INSERT, [to_db(r) for r in rows])
            if counts:
                cur.executemany(UPSERT_COUNT, _count_rows(counts))

    def _close_reads(self) -> None:
        self._pool.close()


class PostgresReader(PostgresReads, Reader):
    """A read-only connection (default_transaction_read_only) to the ledger's tables at `url`."""

    def __init__(self, url: str) -> None:
        self._conn = connect(url, options="-c default_transaction_read_only=on")
        self._conn.execute(bound_statements(READ_TIMEOUT_S))

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return self._conn.execute(pg(sql), args).fetchall()

    def _stream(self, sql: str, args: tuple[Any, ...], size: int) -> Iterator[list[tuple[Any, ...]]]:
        with self._conn.transaction(), self._conn.cursor(name=f"tiergate_read_{uuid.uuid4().hex}") as cur:
            cur.execute(pg(sql), args)
            while batch := cur.fetchmany(size):
                yield batch

    def close(self) -> None:
        self._conn.close()


def _isolated(conn: psycopg.Connection[Any], statements: tuple[Statement, ...]) -> Exception | None:
    """Run statements in a savepoint: their own error undoes only them; a fault of the database propagates."""
    try:
        with conn.transaction():  # nested: a savepoint, rolled back to on an error
            for sql, values in statements:
                conn.execute(sql, values)
    except Exception as exc:
        if is_db_fault(exc):
            raise
        return exc
    return None
