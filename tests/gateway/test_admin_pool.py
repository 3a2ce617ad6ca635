"""The admin stores' pool on the fleet database (gateway/admin_pool.py): a database that cannot be reached, or a
statement it cancels, is a retryable 503 whose message is a fixed sentence in OpenAI's shape; the driver's words
(host, port, user, statement) go to the log, once, and never to the client, even an admin."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from gateway import admin_pool
from gateway.admin_pool import UNAVAILABLE_MESSAGE
from gateway.errors import Unavailable
from gateway.ladder.state import PostgresLadderStore

REFUSED = ('connection failed: connection to server at "10.20.30.40", port 5432 failed: FATAL: password '
           'authentication failed for user "tiergate_fleet"')


def test_an_unreachable_database_is_a_fixed_503_and_the_driver_text_is_logged_once(
        database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store = PostgresLadderStore(database_url)
    try:
        def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise psycopg.OperationalError(REFUSED)

        monkeypatch.setattr(store._db._pool, "connection", unreachable)
        with caplog.at_level(logging.ERROR, logger="tiergate.fleet_db"):
            for _ in range(3):
                with pytest.raises(Unavailable) as caught:
                    store.history()
                err = caught.value
                assert err.status_code == 503 and err.retry_after == 2
                assert err.body() == {"error": {"message": UNAVAILABLE_MESSAGE, "type": "service_unavailable",
                                                "param": None, "code": "database_unavailable"}}
        assert caplog.text.count("10.20.30.40") == 1 and "tiergate_fleet" in caplog.text
    finally:
        store.close()


def test_a_statement_cancelled_on_a_lock_is_a_fixed_503_without_the_server_s_words(
        database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A real fault: another session holds the ladder's table; the statement timeout cancels the read. The server's
    words ("canceling statement due to statement timeout", the statement) were the admin's 503 message."""
    monkeypatch.setattr(admin_pool, "TIMEOUT_S", 0.3)
    store = PostgresLadderStore(database_url)
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE degrade_events IN ACCESS EXCLUSIVE MODE")
        with caplog.at_level(logging.ERROR, logger="tiergate.fleet_db"), pytest.raises(Unavailable) as caught:
            store.history()
        assert caught.value.message == UNAVAILABLE_MESSAGE
        assert "statement timeout" not in str(caught.value) and "statement timeout" in caplog.text
        blocker.rollback()
        assert store.history() == []  # the pool answers again at once
    finally:
        blocker.close()
        store.close()
