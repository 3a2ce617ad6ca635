"""A gateway started while its fleet database (TIERGATE_DATABASE_URL) does not answer waits for it, trying again with
a log line each try, and serves once it answers: no restart, no orchestrator's restart loop. It exited at the first
try (`tiergate serve`: 'Error: the fleet database ... cannot be reached'), so a database's blip with a restart was a
full outage. The wait is bounded (TIERGATE_DATABASE_START_WAIT_S), then one line; a server that refuses who connects
(a role or database that does not exist, a wrong password) is one line at once: configuration, not a blip."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

import gateway.app
from gateway.app import create_app
from gateway.settings import Settings
from gateway.stores import DatabaseUnreachable
from tests.conftest import running_gateway
from tests.pg_proxy import PgProxy
from tests.postgres import PostgresServer
from tests.stubs import ServerThread, StubState, free_port

MSG = [{"role": "user", "content": "Hello"}]


class FirstRetry(logging.Handler):
    """Set once the stores' first 'trying again' line is logged: the gateway is waiting for the database."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if "trying again" in record.getMessage():
            self.seen.set()


@pytest.fixture
def retries() -> Iterator[FirstRetry]:
    handler = FirstRetry()
    logger = logging.getLogger("tiergate.stores")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_the_gateway_waits_for_its_fleet_database_and_serves_once_it_answers(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], database_url: str, pg_proxy: PgProxy,
        retries: FirstRetry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database stops answering as the started app opens its stores (build_services: the ledger first), after
    the harness made the tenant and create_app checked the plans (each of which waits as well: the test below)."""
    settings = gateway_settings.model_copy(update={"database_url": pg_proxy.url(database_url)})
    build = gateway.app.build_services

    def down_first(settings_: Settings) -> object:
        pg_proxy.refusing = True  # the database does not answer: every connection closed at once
        return build(settings_)

    monkeypatch.setattr(gateway.app, "build_services", down_first)
    opened = threading.Thread(target=lambda: retries.seen.wait(60) and pg_proxy.up(), daemon=True)
    opened.start()  # the database answers once the gateway has found it down and waits
    with running_gateway(settings, stub[1]) as gw:
        with gw.client(gw.tenant_key) as c:
            r = c.post("/v1/chat/completions", json={"model": "full", "messages": MSG})
        assert r.status_code == 200, r.text
        rows = gw.ledger_rows()  # in the fleet database, written before the answer
        assert [row.request_id for row in rows] == [r.headers["x-tiergate-request-id"]]
    assert retries.seen.is_set()
    first = next(line for line in retries.lines if "trying again" in line)
    assert "cannot be reached to open the ledger" in first and "TIERGATE_DATABASE_START_WAIT_S" in first
    assert settings.database_url not in first  # host and port only


def test_the_wait_is_bounded_then_one_line(gateway_settings: Settings, retries: FirstRetry) -> None:
    settings = gateway_settings.model_copy(update={
        "database_url": f"postgresql://tiergate:s3cret-pw@127.0.0.1:{free_port()}/fleet",  # nothing listens there
        "database_start_wait_s": 1.0})
    with pytest.raises(DatabaseUnreachable) as caught:
        create_app(settings)
    message = str(caught.value)
    assert message.startswith("the fleet database (TIERGATE_DATABASE_URL) cannot be reached: connection failed")
    assert "TIERGATE_DATABASE_START_WAIT_S=1" in message and "\n" not in message and "s3cret-pw" not in message
    assert retries.seen.is_set()  # it tried again before giving up
    assert not any("s3cret-pw" in line for line in retries.lines)


@pytest.mark.parametrize("what", ["role", "database"])
def test_a_server_refusing_who_connects_stops_start_up_at_once(gateway_settings: Settings,
                                                               postgres_server: PostgresServer, retries: FirstRetry,
                                                               what: str) -> None:
    url = postgres_server.url("no_such_db") if what == "database" else \
        f"postgresql://no_such_role@127.0.0.1:{postgres_server.port}/postgres"
    settings = gateway_settings.model_copy(update={"database_url": url, "database_start_wait_s": 600.0})
    with pytest.raises(DatabaseUnreachable) as caught:
        create_app(settings)
    message = str(caught.value)
    assert "refused the connection for the tenant store" in message and f"{what} \"no_such_" in message, message
    assert "waiting will not fix it" in message and "\n" not in message
    assert not retries.seen.is_set()  # no try again
