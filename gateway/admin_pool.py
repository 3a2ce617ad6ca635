"""The fleet database as an admin store uses it (the ladder's state and audit, the rollouts'): its migrations run
once when it opens, one connection at a time, and an unreachable database is a retryable 503 for whoever asked
(on-call's change fails cleanly; a follower logs it and keeps what it read last)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gateway.errors import Unavailable

TIMEOUT_S = 5.0  # for the connection, then for each statement (one waiting on a lock: a 503)


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

    @contextmanager
    def connection(self) -> Iterator[Any]:
        try:
            with self._pool.connection() as conn:
                yield conn
        except self._unreachable as exc:
            raise Unavailable(f"the fleet database cannot be reached: {str(exc).strip()}",
                              code="database_unavailable", retry_after=2) from exc

    def close(self) -> None:
        self._pool.close()
