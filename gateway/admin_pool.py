"""The fleet database as an admin store uses it (the ladder's state and audit, the rollouts'): its migrations run
once when it opens, one connection at a time, and an unreachable database is a retryable 503 for whoever asked
(on-call's change fails cleanly; a follower logs it and keeps what it read last).

The 503 says a fixed sentence: the driver's words (the server's host and port, the user, a statement, its DETAIL
lines) are the log's, not the client's, even an admin's. A fault is logged once, not once a request, until the
pool answers again (or another fault follows it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gateway.errors import Unavailable
from quotas.fault_log import FaultLog

log = logging.getLogger("tiergate.fleet_db")

TIMEOUT_S = 5.0  # for the connection, then for each statement (one waiting on a lock: a 503)
# what an admin reads while the fleet database cannot be reached; why is in the log
UNAVAILABLE_MESSAGE = "the fleet database cannot be reached now; nothing was changed; retry shortly"


class AdminPool:
    def __init__(self, url: str, *, component: str, migrations: Sequence[str], name: str) -> None:
        import psycopg
        from psycopg_pool import ConnectionPool, PoolTimeout

        from quotas.fleet_db import CONNECT_TIMEOUT_S, bounded, connect, migrate

        with connect(url) as conn:
            migrate(conn, component, migrations)
        self._pool = ConnectionPool(url, min_size=1, max_size=1, open=True, timeout=TIMEOUT_S,
                                    kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                                    configure=bounded(TIMEOUT_S),
                                    check=ConnectionPool.check_connection, name=name)
        self._unreachable = (psycopg.OperationalError, PoolTimeout)
        # a fault logged once (the driver's words, a URL's password blanked), then one line when the pool answers
        self._faults = FaultLog(log, f"{name} store: the fleet database (admin requests get 503)", level=logging.ERROR,
                                rounds="admin requests")

    @contextmanager
    def connection(self) -> Iterator[Any]:
        try:
            with self._pool.connection() as conn:
                yield conn
        except self._unreachable as exc:
            self._faults.failed(exc)
            raise Unavailable(UNAVAILABLE_MESSAGE, code="database_unavailable", retry_after=2) from exc
        self._faults.ok()

    def close(self) -> None:
        self._pool.close()
