"""What a request (or an admin) is told when the fleet database did not answer its tenant-store query, and which key
ids are refused again without a query.

Two kinds of 503, both retryable: `database_unavailable` while the database cannot be reached (a fault: the store's
breaker opens, and the caches are not trusted, since a revocation could be missed), and `database_busy` when it
answered but not with rows (every pool connection lent out, a statement or lock timeout on another session's lock):
the breaker stays closed, so one table held locked is not an outage for every tenant. The driver's words (host,
port, user, DETAIL lines) are the log's, never the tenant's.

A key id whose lookup waited out a lock is refused for its Retry-After without a query (`RefusedKeys`): a hot key
held a lookup thread back to back. Only a refusal is remembered, never a key found. A `database_busy` is logged a
line a breaker's interval at most (`BusyLog`): a table held locked cancels every lookup.
"""

from __future__ import annotations

import logging
import time

from psycopg import errors as pg_errors

from gateway.errors import Unavailable
from gateway.tenants.read_cache import MAX_CACHED

# a query the database gave up on: its statement timeout (or a cancel), a lookup's lock timeout; its caller's 503
WAITED_OUT = (pg_errors.QueryCanceled, pg_errors.LockNotAvailable)

# what a tenant (or an admin) reads while the fleet database cannot be reached; why is in the log
UNAVAILABLE_MESSAGE = "the gateway cannot check API keys or tenants now; retry shortly"

# what a request reads when every connection to the fleet database was busy for the pool's timeout (a burst)
BUSY_MESSAGE = "the gateway is busy checking API keys and tenants; retry shortly"


def unavailable() -> Unavailable:
    return Unavailable(UNAVAILABLE_MESSAGE, code="database_unavailable", retry_after=2)


def busy(retry_after: int) -> Unavailable:
    return Unavailable(BUSY_MESSAGE, code="database_busy", retry_after=retry_after)


def admin_busy(statement_timeout_s: float) -> Unavailable:
    return Unavailable(f"the tenant store is busy: another session held what this change needs for "
                       f"{statement_timeout_s:g} s; nothing was changed, retry shortly", code="database_busy",
                       retry_after=1)


class RefusedKeys:
    """Key ids whose last lookup waited out a lock, each with when its lookups may query again; bounded (MAX_CACHED:
    past it the memory starts again, as the read cache does). Used on the event loop only."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}  # key id -> until when its lookups are refused

    def refused(self, key_id: str) -> bool:
        return self._until.get(key_id, 0.0) > time.monotonic()

    def refuse(self, key_id: str, for_s: float) -> None:
        if len(self._until) >= MAX_CACHED:
            self._until.clear()
        self._until[key_id] = time.monotonic() + for_s

    def forget(self, key_id: str) -> None:
        self._until.pop(key_id, None)


class BusyLog:
    """The log's lines for `database_busy` 503s (no outage: the breaker stays closed), each kind once an `every_s`
    at most, however many requests it refuses meanwhile."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._busy_logged = 0.0  # when an exhausted pool was last logged
        self._cancel_logged = float("-inf")  # when a query cancelled by its statement or lock timeout was last logged

    def pool_busy(self, max_connections: int, pool_timeout_s: float, *, every_s: float) -> None:
        now = time.monotonic()
        if now - self._busy_logged >= every_s:
            self._busy_logged = now
            self._log.warning("tenant store: all %d connections of its pool were busy for %g s; a request got 503 "
                              "(the breaker stays closed)", max_connections, pool_timeout_s)

    def cancelled(self, exc: BaseException, *, lock_timeout_s: float, statement_timeout_s: float,
                  every_s: float) -> None:
        now = time.monotonic()
        if now - self._cancel_logged < every_s:
            return
        self._cancel_logged = now
        if isinstance(exc, pg_errors.LockNotAvailable):
            self._log.warning("tenant store: a query (a key lookup, a data-version read) waited %g s, its lock "
                              "timeout, for another session's lock and gave up; its request got 503 (the breaker "
                              "stays closed): %s", lock_timeout_s, exc)
        else:
            self._log.warning("tenant store: a query (a key lookup, a data-version read) waited %g s, its statement "
                              "timeout, and was cancelled; its request got 503 (the breaker stays closed): %s",
                              statement_timeout_s, exc)
