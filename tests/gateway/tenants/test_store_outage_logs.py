"""What the PostgreSQL tenant store logs while the fleet database is down: each fault once, then one line when it
works again (quotas/fault_log.py), not a line a BREAKER_S from the queries nor silence from the listener."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from gateway.errors import Unavailable
from gateway.tenants import store_postgres
from gateway.tenants.store_postgres import PostgresTenantStore

REFUSED = ('connection failed: connection to server at "10.20.30.40", port 5432 failed: Connection refused\n'
           '\tIs the server running on that host and accepting TCP/IP connections?')
LOST = "consuming input failed: server closed the connection unexpectedly"


@pytest.fixture
def store(database_url: str) -> Iterator[PostgresTenantStore]:
    s = PostgresTenantStore(database_url)
    yield s
    s.close()


def test_failed_queries_log_one_line_then_one_recovery_line(store: PostgresTenantStore,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Twenty lookups in an outage, each past the breaker (as requests a second apart are): one line, then one."""
    monkeypatch.setattr(store_postgres, "BREAKER_S", 0.0)
    pool_connection = store._pool.connection
    down = True

    def connection(*args: Any, **kwargs: Any) -> Any:
        if down:
            raise psycopg.OperationalError(REFUSED)
        return pool_connection(*args, **kwargs)

    monkeypatch.setattr(store._pool, "connection", connection)
    with caplog.at_level(logging.INFO, logger="tiergate.tenants"):
        for _ in range(20):
            with pytest.raises(Unavailable):
                store.authenticate("tg-0123456789ab-" + "x" * 43)
        down = False
        assert store.authenticate("tg-0123456789ab-" + "x" * 43) is None
        store.authenticate("tg-0123456789ab-" + "y" * 43)
    lines = [r.getMessage() for r in caplog.records if r.name == "tiergate.tenants"]
    assert len(lines) == 2, lines
    assert "10.20.30.40" in lines[0] and "\n" not in lines[0]  # the driver's words, on one line
    assert lines[1] == "tenant store: reaching the fleet database (requests get 503) recovered after 20 failed queries"


class _Stop(threading.Event):
    """The listener's stop event, its waits recorded and not slept."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        return self.is_set()


class _Conn:
    """A listener's connection: each round reads the next version (an exception: raised there)."""

    def __init__(self, rounds: list[Any], stop: _Stop) -> None:
        self.rounds, self.stop = rounds, stop

    def __enter__(self) -> _Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def execute(self, sql: str) -> Any:
        if sql.startswith("LISTEN"):
            return None
        version = self.rounds.pop(0)
        if isinstance(version, BaseException):
            raise version
        return _Row(version)

    def notifies(self, **kwargs: Any) -> Iterator[None]:
        if not self.rounds:
            self.stop.set()  # the test's end
        return iter(())


class _Row:
    def __init__(self, version: int) -> None:
        self.version = version

    def fetchone(self) -> tuple[int]:
        return (self.version,)


def _listen_through(store: PostgresTenantStore, monkeypatch: pytest.MonkeyPatch, conns: list[Any]) -> _Stop:
    """Run the listener (on this thread) over `conns`: each a connection's rounds, or an exception connecting (or
    a function that returns one, called as it connects)."""
    stop = _Stop()
    store._stop = stop

    def connect(url: str) -> _Conn:
        item = conns.pop(0)
        if callable(item):
            item = item()
        if isinstance(item, BaseException):
            raise item
        return _Conn(item, stop)

    monkeypatch.setattr(store_postgres, "connect", connect)
    store._listen()
    return stop


def test_the_listener_logs_an_outage_once_and_its_end_once(store: PostgresTenantStore,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Connected, the connection lost, 30 refused reconnects, then back: the loss, the refusal, one recovery line;
    the reconnects back off (doubling to 2 s), and the change counter is unknown (caches untrusted) until back."""
    seen_in_outage: list[int | None] = []

    def refused() -> psycopg.OperationalError:
        seen_in_outage.append(store._seen)
        return psycopg.OperationalError(REFUSED)

    conns: list[Any] = [[7, psycopg.OperationalError(LOST)], *([refused] * 30), [8]]
    with caplog.at_level(logging.INFO, logger="tiergate.tenants"):
        stop = _listen_through(store, monkeypatch, conns)
    lines = [r.getMessage() for r in caplog.records if r.name == "tiergate.tenants"]
    assert len(lines) == 3, lines
    assert LOST in lines[0] and "10.20.30.40" in lines[1] and "\n" not in lines[1]
    assert lines[2].endswith("recovered after 31 failed reconnects")
    assert stop.waits[:6] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0] and max(stop.waits) == 2.0  # no spin, bounded
    assert seen_in_outage == [None] * 30 and store._seen == 8


def test_a_bug_in_the_listener_leaves_the_caches_untrusted_and_it_listening(store: PostgresTenantStore,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """An exception not psycopg's ended the thread with the counter as last read: every replica's caches trusted
    for good, a revocation never heard. Now it is logged with its traceback, the counter unknown, and it goes on."""
    unknown: list[int | None] = []

    def refused() -> psycopg.OperationalError:
        unknown.append(store._seen)
        return psycopg.OperationalError(REFUSED)

    conns: list[Any] = [[7, RuntimeError("odd")], refused, [9]]
    with caplog.at_level(logging.INFO, logger="tiergate.tenants"):
        _listen_through(store, monkeypatch, conns)
    assert unknown == [None]
    errors = [r for r in caplog.records if r.name == "tiergate.tenants" and r.exc_info is not None]
    assert len(errors) == 1 and isinstance(errors[0].exc_info[1], RuntimeError)  # type: ignore[index]
    assert store._seen == 9
