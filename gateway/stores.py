"""The stores a deployment uses, chosen from its settings: the one place that picks SQLite or PostgreSQL.

Embedded (no URL): SQLite files in the data directory. A fleet (`TIERGATE_DATABASE_URL=postgresql://…`):
tenants, keys, data versions, the ledger, refusal counts, idempotency records, the ladder's audit and the
rollouts of model versions in PostgreSQL, whatever Redis holds (README, "Deployment"). The gateway
(gateway/app.py), the CLI and the tests open their stores here, so they always meet on the same state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.ladder.state import LadderStore, open_store
from gateway.rollout.state import RolloutStore
from gateway.rollout.state import open_store as open_rollouts
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from quotas.idempotency import IdempotencyStore
from quotas.idempotency_postgres import PostgresIdempotency
from quotas.idempotency_redis import RedisIdempotency
from quotas.idempotency_sqlite import SQLiteIdempotency
from quotas.ledger import Ledger


class DatabaseUnreachable(Exception):
    """The fleet database could not be reached to open a store (it is down, or the URL is wrong): start-up stops
    with one line that says why, not a driver's traceback."""


@contextmanager
def _reaching() -> Iterator[None]:
    """A store opened on the fleet database (each migrates its tables on open, libpq's connect_timeout bounds the
    wait): its connection failing is `DatabaseUnreachable`, with the driver's first line (host and port, never
    the URL's password: libpq does not repeat it)."""
    import psycopg

    try:
        yield
    except psycopg.OperationalError as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DatabaseUnreachable(f"the fleet database (TIERGATE_DATABASE_URL) cannot be reached: {why}") from exc


def open_tenant_store(settings: Settings) -> TenantStore:
    if settings.database_url:
        from gateway.tenants.store_postgres import PostgresTenantStore

        with _reaching():
            return PostgresTenantStore(settings.database_url, lock_timeout_s=settings.tenant_lookup_lock_timeout_s)
    return TenantStore(settings.state_db)  # SQLite


def open_ledger(settings: Settings) -> Ledger:
    if settings.database_url:
        from quotas.ledger_postgres import PostgresLedger

        with _reaching():
            return PostgresLedger(settings.database_url, read_lock_timeout_s=settings.ledger_read_lock_timeout_s)
    return Ledger(settings.ledger_db, sync=settings.ledger_sync)


def open_idempotency(settings: Settings, ledger: Ledger | None = None) -> IdempotencyStore:
    """Beside the ledger when it is in a database (a `done` record commits with its ledger row), else Redis for
    replicas sharing one, else the ledger's SQLite file. `ledger`: where Redis keeps the claims, what a claim whose
    gateway died is looked up in (its row written: the retry is told it ran, never run and billed again)."""
    if settings.database_url:
        with _reaching():
            return PostgresIdempotency(settings.database_url, max_connections=settings.database_max_connections)
    if settings.redis_url:
        store = RedisIdempotency(settings.redis_url)
        store.rows = ledger
        return store
    return SQLiteIdempotency(settings.ledger_db)


def open_ladder_store(settings: Settings) -> LadderStore:
    with _reaching():
        return open_store(settings.data_dir, settings.redis_url, settings.database_url)


def open_rollout_store(settings: Settings) -> RolloutStore:
    with _reaching():
        return open_rollouts(settings.data_dir, settings.database_url)
