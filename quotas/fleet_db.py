"""The fleet database: PostgreSQL, shared by every gateway replica (`TIERGATE_DATABASE_URL=postgresql://…`).

What lives there: tenants, keys (hashes), data versions (gateway/tenants/store_postgres.py), the usage ledger,
refusal counts and idempotency records (quotas/ledger_postgres.py, quotas/idempotency.py), and the ladder's
audit (gateway/ladder/state.py). Each store owns its tables as one *component* with a numbered list of
migrations; `migrate` applies the ones a database lacks, in order, each in a transaction with its version's row,
under an advisory lock, so replicas that start together apply each migration once and a fleet's database is
upgraded in place by the first replica of a new release. Migrations only add (tables, columns with defaults,
indexes, triggers), so replicas of the previous release keep working beside it during a rolling upgrade.

An index on a table the gateway writes on its hot path is a `ConcurrentIndex`: built by CREATE INDEX CONCURRENTLY,
outside a transaction, so the table's writes go on while it builds (CREATE INDEX in a transaction blocks them until
it commits). The lock is then a session's, not a transaction's, and a replica waiting for it polls
(`pg_try_advisory_lock`) rather than wait in a statement: the build waits for every transaction with an older
snapshot to end, and a statement waiting for the lock would hold one, a deadlock. The wait is bounded
(LOCK_WAIT_S): a session that holds the lock and never lets go (a replica hung mid-migration, an operator's psql
left open) stops start-up with `MigrationLockTimeout`, naming that session (its pid, application, client, state,
statement), rather than hold the process forever with nothing in its log. A migration in a transaction waits
at most TABLE_LOCK_WAIT_S for a table another session's transaction holds (`lock_timeout`), then lets go and tries
again, TABLE_LOCK_TRIES times in all: while an ALTER TABLE waits for its lock every statement on that table queues
behind it, the request path's too, so it must not wait long; after the last try start-up stops, naming the
oldest open transactions.

The stores share this module's conventions: SQL is written once with `?` placeholders, as SQLite takes them,
and `pg` turns them into psycopg's `%s`; `is_db_fault` tells a fault of the database (retry later) from one a
row's own values caused (refuse that row).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import errors as pg_errors

log = logging.getLogger("tiergate.fleet_db")

CONNECT_TIMEOUT_S = 5  # libpq's connect_timeout: whole seconds
_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS tiergate_migrations (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (component, version)
)"""
_MIGRATION_LOCK = 0x7469657267617465  # "tiergate": one advisory lock for every component's migrations
LOCK_POLL_S = 0.05  # between tries for it, while another replica migrates
LOCK_WAIT_S = 300.0  # ...for at most this long (an index built concurrently on a long table takes minutes)
TABLE_LOCK_WAIT_S = 2.0  # a migration's wait for a table's lock, each try (what the tables' statements queue behind)
TABLE_LOCK_TRIES = 10


class MigrationLockTimeout(psycopg.Error):
    """Another session held the migration lock longer than LOCK_WAIT_S: start-up stops, naming it."""


@dataclass(frozen=True)
class ConcurrentIndex:
    """A migration that builds index `name` ON `on` ("table(columns)") with CREATE INDEX CONCURRENTLY. One left
    INVALID by an interrupted build (a crash, a cancel) is dropped and built again; a valid one (built, then the
    process died before its version was recorded) is kept."""

    name: str
    on: str

    def apply(self, conn: psycopg.Connection[Any]) -> None:
        valid = conn.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
                             (self.name,)).fetchone()
        if valid == (True,):
            return
        if valid is not None:
            log.warning("fleet database: index %s was left invalid by an interrupted build; building it again",
                        self.name)
            conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {self.name}")
        conn.execute(f"CREATE INDEX CONCURRENTLY {self.name} ON {self.on}")


Migration = str | ConcurrentIndex


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0] in ("postgresql", "postgres")  # type: ignore[union-attr]


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection in autocommit mode (transactions are explicit), failing after CONNECT_TIMEOUT_S."""
    return psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, **kwargs)


def bound_statements(timeout_s: float) -> str:
    """`SET statement_timeout` for a pool's connections (its `configure`): a statement waiting on a lock another
    session holds (an operator's LOCK TABLE, a long ALTER) is cancelled after `timeout_s` (SQLSTATE 57014, an
    OperationalError: a retryable 503) instead of holding its request, and its connection, without end. Set per
    connection, not in the URL's `options`, which the URL's own would clobber."""
    return f"SET statement_timeout = {max(1, int(timeout_s * 1000))}"


def bounded(timeout_s: float) -> Callable[[psycopg.Connection[Any]], None]:
    """A sync pool's `configure`: its connections' statements bounded by `timeout_s` (`bound_statements`)."""
    sql = bound_statements(timeout_s)

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql)

    return configure


@lru_cache(maxsize=256)
def pg(sql: str) -> str:
    """SQL written with SQLite's `?` placeholders, for psycopg (none of our statements has a literal `?` or %)."""
    return sql.replace("?", "%s")


def migrate(conn: psycopg.Connection[Any], component: str, migrations: Sequence[Migration], *,
            upto: int | None = None) -> int:
    """Apply `component`'s migrations numbered 1..`upto` (default: all) that the database lacks; returns the
    version it is at. A database already past what this code knows (a newer release) is left as it is. `conn` is
    in autocommit mode (a `ConcurrentIndex` runs outside a transaction)."""
    target = len(migrations) if upto is None else upto
    deadline = time.monotonic() + LOCK_WAIT_S
    while not conn.execute("SELECT pg_try_advisory_lock(%s)", (_MIGRATION_LOCK,)).fetchone()[0]:  # type: ignore[index]
        if time.monotonic() >= deadline:
            raise MigrationLockTimeout(f"{component}'s migrations waited {LOCK_WAIT_S:g} s for the fleet database's "
                                       f"migration lock (advisory lock {_MIGRATION_LOCK}), held by "
                                       f"{_lock_holder(conn)}; if that session is stuck, end it with "
                                       "pg_terminate_backend(its pid) and start again")
        time.sleep(LOCK_POLL_S)
    try:
        conn.execute(_MIGRATIONS_TABLE)
        done = {v for (v,) in conn.execute("SELECT version FROM tiergate_migrations WHERE component = %s",
                                           (component,))}
        for version, migration in enumerate(migrations[:target], start=1):
            if version in done:
                continue
            if isinstance(migration, ConcurrentIndex):
                migration.apply(conn)
                _applied(conn, component, version)
            else:
                _apply(conn, component, version, migration)
            log.warning("fleet database: %s migrated to version %d", component, version)
            done.add(version)
    finally:
        if not conn.closed and not conn.broken:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK,))
    newest = max(done, default=0)
    if newest > len(migrations):
        log.warning("fleet database: %s is at version %d, newer than this release knows (%d); its additions are "
                    "ignored", component, newest, len(migrations))
    return newest


def _apply(conn: psycopg.Connection[Any], component: str, version: int, migration: str) -> None:
    """`migration` and its version's row in one transaction, its waits for table locks bounded (module docstring)."""
    for attempt in range(1, TABLE_LOCK_TRIES + 1):
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = {max(1, int(TABLE_LOCK_WAIT_S * 1000))}")
                conn.execute(migration)  # several statements, no parameters
                _applied(conn, component, version)
            return
        except pg_errors.LockNotAvailable as exc:
            if attempt == TABLE_LOCK_TRIES:
                raise MigrationLockTimeout(
                    f"{component}'s migration {version} could not lock its tables: another session's transaction "
                    f"held them through {TABLE_LOCK_TRIES} tries of {TABLE_LOCK_WAIT_S:g} s; nothing of it was "
                    f"applied. The oldest open transactions: {_oldest_transactions(conn)}") from exc
            log.warning("fleet database: %s's migration %d waited %g s for a table another session holds; trying "
                        "again (%d of %d)", component, version, TABLE_LOCK_WAIT_S, attempt + 1, TABLE_LOCK_TRIES)
            time.sleep(LOCK_POLL_S * 10)  # what queued behind the ALTER runs meanwhile


def _oldest_transactions(conn: psycopg.Connection[Any]) -> str:
    rows = conn.execute(
        "SELECT pid, application_name, state, EXTRACT(EPOCH FROM now() - xact_start)::int, "
        "left(regexp_replace(query, '\\s+', ' ', 'g'), 200) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL ORDER BY xact_start LIMIT 3").fetchall()
    return "; ".join(f"pid {pid} (application {app or '-'!r}, {state}, open {age} s, last statement: {query!r})"
                     for pid, app, state, age, query in rows) or "none now (start again)"


def _lock_holder(conn: psycopg.Connection[Any]) -> str:
    """Who holds the migration lock, in words: its backend's pid, application, client, state and last statement
    (what pg_stat_activity shows this user), or that it was let go meanwhile."""
    row = conn.execute(
        "SELECT l.pid, a.application_name, host(a.client_addr), a.state, "
        "EXTRACT(EPOCH FROM now() - a.state_change)::int, left(regexp_replace(a.query, '\\s+', ' ', 'g'), 200) "
        "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.classid::bigint = %s AND l.objid::bigint = %s AND l.objsubid = 1 LIMIT 1",
        (_MIGRATION_LOCK >> 32, _MIGRATION_LOCK & 0xFFFFFFFF)).fetchone()
    if row is None:
        return "a session that has let it go since (start again)"
    pid, app, client, state, for_s, query = row
    return (f"PostgreSQL backend pid {pid} (application {app or '-'!r}, client {client or 'local'}, "
            f"{state or 'state unknown'}{f' for {for_s} s' if for_s is not None else ''}, last statement: "
            f"{query or 'not shown to this user'!r})")


def _applied(conn: psycopg.Connection[Any], component: str, version: int) -> None:
    conn.execute("INSERT INTO tiergate_migrations VALUES (%s, %s, %s)", (component, version, time.time()))


def version_of(conn: psycopg.Connection[Any], component: str) -> int:
    """The newest migration applied for `component` (0: none, or no migrations table yet)."""
    if conn.execute("SELECT to_regclass('tiergate_migrations')").fetchone()[0] is None:  # type: ignore[index]
        return 0
    row = conn.execute("SELECT max(version) FROM tiergate_migrations WHERE component = %s", (component,)).fetchone()
    return int(row[0] or 0) if row else 0


def is_db_fault(exc: BaseException) -> bool:
    """A fault of the database or the way to it (connection lost, disk full, shutting down, a deadlock): retry
    later. Not one: a constraint or a value the row brought (a duplicate id, a number out of range), or a
    Python value psycopg cannot send at all."""
    if isinstance(exc, pg_errors.IntegrityError | pg_errors.DataError):
        return False
    if isinstance(exc, psycopg.ProgrammingError) and exc.sqlstate is None:  # refused before it was sent
        return False
    return isinstance(exc, psycopg.Error)


# SQLSTATEs of a database that is not there now but may be soon: a connection failing or lost (class 08), shutting
# down or starting up (57P01-57P03), no connection slot free (53300), a lock or statement timed out (55P03, 57014)
_OUTAGE_STATES = frozenset({"57P01", "57P02", "57P03", "53300", "55P03", "57014"})
# what a server answers (a FATAL, whose SQLSTATE psycopg does not keep for a failed connect) while it cannot take a
# connection yet: "the database system is starting up" (or shutting down, in recovery, not yet accepting connections),
# "sorry, too many clients already", "remaining connection slots are reserved ..."
_NOT_YET = ("the database system is", "too many clients", "remaining connection slots")


def is_outage(exc: psycopg.OperationalError) -> bool:
    """A failure to connect (or to migrate on a connection) that waiting may mend: nothing answered (refused, timed
    out, a host name not resolved yet, the connection cut), or the server is starting, stopping or full. Not one: the
    server's refusal of who connects (a wrong password, a role or database that does not exist, no pg_hba.conf entry):
    configuration, which no wait mends. A server whose messages are not in English is taken as not answering, so its
    refusal is waited on (and then named) rather than a blip taken for a refusal."""
    state = exc.sqlstate
    if state is not None:
        return state.startswith("08") or state in _OUTAGE_STATES
    text = str(exc)
    return "FATAL:" not in text or any(words in text for words in _NOT_YET)


def fault_name(exc: BaseException) -> str:
    """What to call a fault in a log line or a not-ready reason: its SQLSTATE's name, else its class."""
    diag = getattr(exc, "sqlstate", None)
    return f"{type(exc).__name__} {diag}" if diag else type(exc).__name__
