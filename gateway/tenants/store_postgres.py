"""`PostgresTenantStore`: tenants, keys (hashes) and data versions in the fleet's PostgreSQL, shared by replicas on
any host.

The rules are gateway/tenants/store.py's `TenantStore`; this supplies the statements, the exclusive transaction (an
advisory lock: key rotations are serialised fleet-wide) and how a replica hears that another committed: every write
to the three tables bumps a change counter and sends a NOTIFY (gateway/tenants/postgres_schema.py). A listener thread
per replica waits on LISTEN and reads the counter, at the latest every POLL_S even when a notification is lost; each
request compares that counter with the one its caches were filled at, which costs no query. A revoked key, a new
tenant, a plan change or a data-version bump thus reaches every replica's next request within milliseconds, within
POLL_S + a query at worst.

Reads that miss the cache are queries on a small pool; the cache makes them rare (a key's first use, a change),
but not rare enough for the event loop: a key id is the client's to choose, so a flood of made-up ids is a query
each. The gateway authenticates with `authenticate_async`, which runs such a lookup on LOOKUP_THREADS threads of
its own, never on the event loop (a round trip there stalls every request); concurrent lookups of one id
share one query, and past MAX_LOOKUPS ids waiting at once a lookup is refused with a retryable 503 at once
rather than queued without end; not that of an id this replica has found a key for before (a change empties
the caches, and a flood must not then lock every tenant out: theirs wait at most MAX_LOOKUPS queries). A change
empties every tenant's cached data version too, and each tenant's next cacheable request reads it again: on the
same threads (`data_version_async`), so a read waiting on a lock (a migration, an operator's LOCK TABLE: up to the
statement timeout) holds up that tenant's request, never the loop.

While the database cannot be reached the caches are not trusted, since a revocation could be missed: requests get
a retryable 503 (fail closed; the ledger could not record them either), and a query that failed makes the next ones
fail at once for BREAKER_S rather than each waiting on the network. A database that answered, but not with rows, is
no such fault: every connection of the pool lent out (a burst; a pool that timed out with connections to spare could
not make one, and that is a fault), a query that waited out its statement timeout or (a lookup) its short lock
timeout on another session's lock: that request gets a 503 of its own (`database_busy`) and the breaker stays closed
for every tenant. What each 503 says, and the key ids refused again for their Retry-After without a query, are
gateway/tenants/postgres_refusals.py's; the lookups' bound on a lock wait (LOCK_TIMEOUT_S) is
gateway/tenants/postgres_lock_timeout.py's.

The admin routes' calls (`TenantStore.admin`) run on the store's admin thread, one at a time, so an admin's query
waiting on a lock (its statement timeout) or for a connection of the pool (its timeout) waits there, not on the
event loop, and holds one connection of the pool at most. An admin's change that waited out its statement timeout
on another session's lock is the admin's retryable 503 (`database_busy`), not a fault: the database answered, and
the breaker stays closed for every tenant.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NoReturn

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool, PoolTimeout

from gateway.errors import Unavailable
from gateway.tenants.postgres_lock_timeout import LookupLockTimeout
from gateway.tenants.postgres_refusals import (
    BUSY_MESSAGE,
    UNAVAILABLE_MESSAGE,
    WAITED_OUT,
    BusyLog,
    RefusedKeys,
    admin_busy,
    busy,
    unavailable,
)
from gateway.tenants.postgres_schema import CHANGE_COUNTER_SQL, CHANNEL, MIGRATIONS, open_schema
from gateway.tenants.read_cache import MAX_CACHED, _Entry
from gateway.tenants.store import P, T, TenantStore
from quotas.fault_log import FaultLog
from quotas.fleet_db import CONNECT_TIMEOUT_S, bounded, connect, pg

# what callers and tests import from here: the messages, the schema
__all__ = ["BUSY_MESSAGE", "MIGRATIONS", "UNAVAILABLE_MESSAGE", "PostgresTenantStore", "open_schema"]

log = logging.getLogger("tiergate.tenants")

POLL_S = 0.5  # the listener reads the change counter at least this often, notification or not
BREAKER_S = 1.0  # after a failed query, queries fail at once for this long
LISTEN_BACKOFF_S = (0.1, 2.0)  # the listener's reconnects while the database is down: first wait, doubling to the last
LOOKUP_THREADS = 2  # threads for the event loop's key lookups; the pool keeps the rest of its connections
STATEMENT_TIMEOUT_S = 5.0  # a query (a lookup, an admin change, a rotation's lock) waits no longer
LOCK_TIMEOUT_S = 0.2  # ...and a lookup no longer for another session's lock (the setting's default; 0: no bound)
BUSY_RETRY_AFTER_S = 1  # a `database_busy` 503's Retry-After; a key refused for a lock wait is refused this long
MAX_LOOKUPS = 64  # key ids looked up or waiting at once; past it a lookup is a 503 (a flood, or the database slow)
_ROTATION_LOCK = 0x726F74617465  # "rotate"


class PostgresTenantStore(TenantStore):
    """The store in the fleet database at `url` (postgresql://…); its tables are migrated on open."""

    _conflict = (pg_errors.UniqueViolation,)

    def __init__(self, url: str, *, max_connections: int = 4, timeout_s: float = 2.0,
                 lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        super().__init__()
        self.url = url
        open_schema(url)
        self._lock_timeout = LookupLockTimeout(lock_timeout_s)  # the lookups' bound on a lock wait
        self._bound = bounded(STATEMENT_TIMEOUT_S)  # a lookup waiting on a lock, or slow: a 503
        self._pool = ConnectionPool(url, min_size=1, max_size=max_connections, open=True, timeout=timeout_s,
                                    kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                                    configure=self._configure, check=ConnectionPool.check_connection, name="tenants")
        self._tx = threading.local()  # this thread's open transaction's connection, if any; the admin thread's flag
        self._seen: int | None = None  # the change counter as the listener last read it; None: unknown
        self._filled_at: int | None = None  # ...and as it was when the caches were last emptied
        self._broken_until = 0.0
        self._max_connections = max_connections
        self._lent = 0  # pool connections our queries hold now (`_connection`)
        self._lent_lock = threading.Lock()
        self._busy_log = BusyLog(log)  # a 503 that is no outage: a line a BREAKER_S at most
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="tenant-lookup",
                                           initializer=self._lock_timeout.on_lookup_thread)
        self._pending: dict[str, tuple[int, asyncio.Future[_Entry | None]]] = {}  # key id -> (generation, lookup)
        self._real: dict[str, None] = {}  # ids found to be keys, kept when the caches are emptied (not made up)
        self._refused = RefusedKeys()  # ids whose last lookup waited out a lock: refused for their Retry-After
        self._pending_versions: dict[str, tuple[int, asyncio.Future[int]]] = {}  # tenant -> (generation, its read)
        # an outage in the log: each fault once, then one line when it works again (not one a BREAKER_S, a reconnect)
        self._query_faults = FaultLog(log, "tenant store: reaching the fleet database (requests get 503)",
                                      level=logging.ERROR, rounds="queries")
        self._listen_faults = FaultLog(log, "tenant store: listening for the fleet database's changes (requests get "
                                            "503 until it reads them again)", level=logging.ERROR, rounds="reconnects")

    def close(self) -> None:
        self._close_admin()
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=POLL_S + CONNECT_TIMEOUT_S + 1)
        self._lookups.shutdown(wait=True, cancel_futures=True)
        self._pool.close()

    # ---- the event loop's lookups ----

    async def _lookup(self, key_id: str) -> _Entry | None:
        """The key id's entry, queried on a lookup thread: the loop only waits, serving everyone else. What is
        found is cached on the loop (`_keep`, in the future's callback), where the caches are emptied too. Lookups
        of one id share one query begun since the caches were last emptied: one begun before may have read the key
        before its revocation, which this request must see."""
        loop = asyncio.get_running_loop()
        generation = self._generation
        pending = self._pending.get(key_id)
        if pending is None or pending[0] != generation or pending[1].get_loop() is not loop:
            if self._refused.refused(key_id):  # its last lookup waited out a lock: not again yet
                raise busy(BUSY_RETRY_AFTER_S)
            if len(self._pending) >= MAX_LOOKUPS and key_id not in self._real:
                raise Unavailable("too many API keys are being looked up at once; retry shortly",
                                  code="key_lookups_busy", retry_after=1)
            lookup = loop.run_in_executor(self._lookups, self._fetch_entry, key_id)
            pending = self._pending[key_id] = (generation, lookup)
            lookup.add_done_callback(lambda done: self._looked_up(key_id, done, generation))
        return await asyncio.shield(pending[1])  # a waiter that leaves does not cancel the others' query

    def _looked_up(self, key_id: str, done: asyncio.Future[_Entry | None], generation: int) -> None:
        pending = self._pending.get(key_id)
        if pending is not None and pending[1] is done:
            del self._pending[key_id]
        if done.cancelled():
            return
        failed = done.exception()
        if failed is None:
            self._refused.forget(key_id)
            self._keep(key_id, done.result(), generation)
        elif isinstance(failed.__cause__, WAITED_OUT):  # a refusal, remembered (`_lookup`); never a key found
            self._refused.refuse(key_id, BUSY_RETRY_AFTER_S)

    async def _version_lookup(self, tenant: str) -> int:
        """The tenant's data version, queried on a lookup thread: the loop only waits, serving everyone else (any
        write empties every tenant's version, and one read waiting on a lock held its statement timeout froze every
        tenant's requests). Reads of one tenant share one query, begun since the caches were last emptied: one begun
        before may have missed the change that emptied them, which this request must see. What is read is cached
        on the loop (`_keep_version`, in the future's callback). Not bounded as key lookups are: the tenant is the
        one a key was found for, never a name the client made up."""
        loop = asyncio.get_running_loop()
        generation = self._generation
        pending = self._pending_versions.get(tenant)
        if pending is None or pending[0] != generation or pending[1].get_loop() is not loop:
            read = loop.run_in_executor(self._lookups, self._fetch_version, tenant)
            pending = self._pending_versions[tenant] = (generation, read)
            read.add_done_callback(lambda done: self._version_read(tenant, done, generation))
        return await asyncio.shield(pending[1])  # a waiter that leaves does not cancel the others' query

    def _version_read(self, tenant: str, done: asyncio.Future[int], generation: int) -> None:
        pending = self._pending_versions.get(tenant)
        if pending is not None and pending[1] is done:
            del self._pending_versions[tenant]
        if not done.cancelled() and done.exception() is None:
            self._keep_version(tenant, done.result(), generation)

    def _keep(self, key_id: str, entry: _Entry | None, generation: int) -> None:
        super()._keep(key_id, entry, generation)
        if entry is not None:
            if len(self._real) >= MAX_CACHED:
                self._real.clear()
            self._real[key_id] = None

    def _as_admin(self, action: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        self._tx.admin = True  # the admin thread's, for `_connection`
        try:
            return action(*args, **kwargs)
        finally:
            self._tx.admin = False

    # ---- statements ----

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """A new pool connection: its statement timeout, and the lookups' lock timeout (`LookupLockTimeout`)."""
        self._bound(conn)
        self._lock_timeout.configure(conn)

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """This thread's transaction's connection, else one from the pool; unreachable means a 503."""
        conn = getattr(self._tx, "conn", None)
        if conn is not None:
            yield conn
            return
        if time.monotonic() < self._broken_until:
            raise unavailable()
        full = self._lent >= self._max_connections  # every connection lent as this one starts to wait
        try:
            with self._pool.connection() as conn, self._lending(), self._lock_timeout.lifted(conn):
                self._query_faults.ok()
                yield conn
        except PoolTimeout as exc:
            if full or self._lent >= self._max_connections:  # overload: the queries holding them are answered
                self._busy_log.pool_busy(self._max_connections, self._pool.timeout, every_s=BREAKER_S)
                raise busy(BUSY_RETRY_AFTER_S) from exc
            self._trip(exc)  # connections to spare, yet none came: the pool cannot make one
        except WAITED_OUT as exc:
            # a statement waited out its timeout (another session's lock, a slow moment), a lookup its lock
            # timeout, or an operator cancelled it: the database answered, so this is its caller's retryable 503
            # and the breaker stays closed for every tenant (an outage is a connection's fault: OperationalError,
            # below); the server's words are the log's
            if getattr(self._tx, "admin", False):
                log.warning("tenant store: an admin change waited %g s on another session's lock and was not "
                            "made: %s", STATEMENT_TIMEOUT_S, exc)
                raise admin_busy(STATEMENT_TIMEOUT_S) from exc
            self._busy_log.cancelled(exc, lock_timeout_s=self._lock_timeout.seconds,
                                     statement_timeout_s=STATEMENT_TIMEOUT_S, every_s=BREAKER_S)
            raise busy(BUSY_RETRY_AFTER_S) from exc
        except psycopg.OperationalError as exc:
            self._trip(exc)

    @contextmanager
    def _lending(self) -> Iterator[None]:
        with self._lent_lock:
            self._lent += 1
        try:
            yield
        finally:
            with self._lent_lock:
                self._lent -= 1

    def _trip(self, exc: BaseException) -> NoReturn:
        """A fault of the database or the way to it: queries fail at once for BREAKER_S."""
        self._broken_until = time.monotonic() + BREAKER_S
        # the driver's words (the server's host and port, the user, its DETAIL lines) are the log's, not the
        # tenant's: once an outage, as the queries in between fail at once without asking (the breaker)
        self._query_faults.failed(exc)
        raise unavailable() from exc

    def _fetchone(self, sql: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        with self._connection() as conn:
            return conn.execute(pg(sql), args).fetchone()

    def _fetchall(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._connection() as conn:
            return conn.execute(pg(sql), args).fetchall()

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        with self._connection() as conn:
            conn.execute(pg(sql), args)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ROTATION_LOCK,))
            self._tx.conn = conn
            try:
                yield
            finally:
                self._tx.conn = None

    # ---- hearing about changes ----

    def _changed_elsewhere(self) -> bool:
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="tenant-store-listener", daemon=True)
            self._listener.start()
        seen = self._seen
        if seen is None or seen != self._filled_at:  # a change, or the listener cannot tell: refill
            self._filled_at = seen
            return True
        return False

    def _listen(self) -> None:
        """LISTEN for changes and read the counter after each, and every POLL_S; reconnect with backoff. Whatever
        fails (the database, or a bug) leaves the caches untrusted (`_seen` None) and the thread alive."""
        first, most = LISTEN_BACKOFF_S
        backoff = first
        while not self._stop.is_set():
            try:
                with connect(self.url) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not self._stop.is_set():
                        row = conn.execute(CHANGE_COUNTER_SQL).fetchone()
                        self._seen, backoff = int(row[0]) if row else None, first
                        self._listen_faults.ok()
                        for _ in conn.notifies(timeout=POLL_S, stop_after=1):
                            pass
            except Exception as exc:
                self._seen = None
                self._listen_faults.failed(exc)
                self._stop.wait(backoff)
                backoff = min(most, backoff * 2)

