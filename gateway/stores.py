"""The stores a deployment uses, chosen from its settings: the one place that picks SQLite or PostgreSQL.

Embedded (no URL): SQLite files in the data directory. A fleet (`TIERGATE_DATABASE_URL=postgresql://…`):
tenants, keys, data versions, the ledger, refusal counts, idempotency records, the ladder's audit and the
rollouts of model versions in PostgreSQL, whatever Redis holds (README, "Deployment"). The gateway
(gateway/app.py), the CLI and the tests open their stores here, so they always meet on the same state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

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
    """The fleet database could not be reached to open a store (down past TIERGATE_DATABASE_START_WAIT_S, or it
    refused who connects): start-up stops with one line that says why, not a driver's traceback."""


log = logging.getLogger("tiergate.stores")
FIRST_PAUSE_S = 0.5  # between tries to open a store on a fleet database that does not answer, doubled each try...
MAX_PAUSE_S = 5.0  # ...up to this (each try waits up to fleet_db.CONNECT_TIMEOUT_S for an answer too)
_SETTING = "TIERGATE_DATABASE_START_WAIT_S"

T = TypeVar("T")


def _reach(what: str, open_: Callable[[], T], wait_s: float) -> T:
    """`open_()`, a store on the fleet database (each migrates its tables on open; libpq's connect_timeout bounds a
    try). A database that does not answer yet (fleet_db.is_outage: down, starting, full) is tried again with a growing
    pause and a log line each try, for `wait_s` (0: one try), so that a replica started during a database's
    blip (an orchestrator's restart, the database's own) waits for it rather than exit into a restart loop; then
    `DatabaseUnreachable`. A refusal of who connects (a wrong password, no such role or database) is one at once. Its
    message has the driver's first line (host and port, never the URL's password: libpq does not repeat it)."""
    import psycopg

    from quotas.fleet_db import is_outage

    budget_s = wait_s
    started = time.monotonic()
    pause_s = FIRST_PAUSE_S
    while True:
        try:
            return open_()
        except psycopg.OperationalError as exc:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if not is_outage(exc):
                if exc.sqlstate is None:  # the server's answer to the connect
                    raise DatabaseUnreachable(f"the fleet database (TIERGATE_DATABASE_URL) refused the connection "
                                              f"for {what}: {why}; check the URL's user, password and database "
                                              "(waiting will not fix it)") from exc
                # a fault of the database that no wait mends (its disk full), at once as before
                raise DatabaseUnreachable(f"the fleet database (TIERGATE_DATABASE_URL) cannot be reached: "
                                          f"{why}") from exc
            waited_s = time.monotonic() - started
            if waited_s >= budget_s:
                tried = f" (tried for {waited_s:.0f} s, {_SETTING}={budget_s:g})" if budget_s > 0 else ""
                raise DatabaseUnreachable(f"the fleet database (TIERGATE_DATABASE_URL) cannot be reached: {why}"
                                          f"{tried}") from exc
            pause_s = min(pause_s, budget_s - waited_s)
            log.warning("the fleet database (TIERGATE_DATABASE_URL) cannot be reached to open %s: %s; trying again in "
                        "%.1f s (waited %.0f s of %g s, %s)", what, why, pause_s, waited_s, budget_s, _SETTING)
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, MAX_PAUSE_S)


def open_tenant_store(settings: Settings, *, wait_s: float = 0.0) -> TenantStore:
    """`wait_s`, here and below: how long a fleet database that does not answer is waited for; 0 (one try) unless
    the caller is the gateway starting (`tiergate serve`, create_app: TIERGATE_DATABASE_START_WAIT_S), so that an
    operator's CLI command answers at once rather than wait a minute for a database that is down."""
    if settings.database_url:
        from gateway.tenants.store_postgres import PostgresTenantStore

        url = settings.database_url
        return _reach("the tenant store", lambda: PostgresTenantStore(
            url, lock_timeout_s=settings.tenant_lookup_lock_timeout_s), wait_s)
    return TenantStore(settings.state_db)  # SQLite


def open_ledger(settings: Settings, *, wait_s: float = 0.0) -> Ledger:
    if settings.database_url:
        from quotas.ledger_postgres import PostgresLedger

        url = settings.database_url
        return _reach("the ledger", lambda: PostgresLedger(
            url, read_lock_timeout_s=settings.ledger_read_lock_timeout_s), wait_s)
    return Ledger(settings.ledger_db, sync=settings.ledger_sync)


def open_idempotency(settings: Settings, ledger: Ledger | None = None, *,
                     wait_s: float = 0.0) -> IdempotencyStore:
    """Beside the ledger when it is in a database (a `done` record commits with its ledger row), else Redis for
    replicas sharing one, else the ledger's SQLite file. `ledger`: where Redis keeps the claims, what a claim whose
    gateway died is looked up in (its row written: the retry is told it ran, never run and billed again)."""
    if settings.database_url:
        url = settings.database_url
        return _reach("the idempotency records", lambda: PostgresIdempotency(
            url, max_connections=settings.database_max_connections), wait_s)
    if settings.redis_url:
        store = RedisIdempotency(settings.redis_url)
        store.rows = ledger
        return store
    return SQLiteIdempotency(settings.ledger_db)


def open_ladder_store(settings: Settings, *, wait_s: float = 0.0) -> LadderStore:
    return _reach("the ladder's store", lambda: open_store(
        settings.data_dir, settings.redis_url, settings.database_url), wait_s)


def open_rollout_store(settings: Settings, *, wait_s: float = 0.0) -> RolloutStore:
    return _reach("the rollouts' store", lambda: open_rollouts(settings.data_dir, settings.database_url),
                  wait_s)
