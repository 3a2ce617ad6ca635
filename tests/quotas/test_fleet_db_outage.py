"""quotas.fleet_db.is_outage: what start-up waits for (gateway/stores.py) and what it stops on at once. A database
not there yet (nothing answers, starting up, shutting down, full, a connection lost) is waited for; a server that
refuses who connects is configuration. A failed connect reaches psycopg without its SQLSTATE, so the server's answer
is read from the message; after a connect (a migration's statements) the SQLSTATE decides."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors as pg_errors

from quotas.fleet_db import is_outage

AT = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '


@pytest.mark.parametrize("message", [
    AT + "Connection refused",
    AT + "timeout expired",
    "connection failed: could not translate host name \"db.internal\" to address: Name or service not known",
    AT + "server closed the connection unexpectedly",
    AT + "FATAL:  the database system is starting up",
    AT + "FATAL:  the database system is shutting down",
    AT + "FATAL:  the database system is not yet accepting connections",
    AT + "FATAL:  sorry, too many clients already",
    AT + "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
])
def test_a_database_not_there_yet_is_waited_for(message: str) -> None:
    assert is_outage(psycopg.OperationalError(message))


@pytest.mark.parametrize("message", [
    AT + 'FATAL:  password authentication failed for user "tiergate"',
    AT + 'FATAL:  role "tiergate" does not exist',
    AT + 'FATAL:  database "fleet" does not exist',
    AT + 'FATAL:  no pg_hba.conf entry for host "10.0.0.7", user "tiergate", database "fleet", no encryption',
])
def test_a_server_refusing_who_connects_is_not_waited_for(message: str) -> None:
    assert not is_outage(psycopg.OperationalError(message))


@pytest.mark.parametrize(("error", "outage"), [
    (pg_errors.ConnectionFailure, True), (pg_errors.AdminShutdown, True), (pg_errors.CannotConnectNow, True),
    (pg_errors.TooManyConnections, True), (pg_errors.LockNotAvailable, True), (pg_errors.QueryCanceled, True),
    (pg_errors.InvalidPassword, False), (pg_errors.InvalidAuthorizationSpecification, False),
    (pg_errors.DiskFull, False),
])
def test_after_a_connect_the_sqlstate_decides(error: type[psycopg.OperationalError], outage: bool) -> None:
    assert is_outage(error("FATAL:  the database system is starting up")) is outage  # the state, not the words
