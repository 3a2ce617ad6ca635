"""What a tenant reads when the usage ledger cannot write: a fixed sentence, the Retry-After and its request id, never
the database driver's error (for PostgreSQL: the server's address, the user, its DETAIL lines). The operator keeps
it: the log has it, and /health shows it to an admin key."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import psycopg
import pytest

from gateway.errors import LEDGER_UNAVAILABLE_MESSAGE, NOT_READY_MESSAGE, USAGE_LATE_MESSAGE, client_error
from quotas.ledger import LedgerUnavailable
from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hello there"}]
# what a PostgreSQL ledger's writer is told when its server runs out of disk (psycopg's words, multi-line)
DRIVER_ERROR = ('connection to server at "10.20.30.40", port 5432 failed: FATAL: could not extend file '
                '"base/16384/16385": No space left on device\nDETAIL: user "tiergate_ledger"')
LEAKS = ("10.20.30.40", "5432", "tiergate_ledger", "No space left", "DETAIL", "OperationalError")


class BrokenDisk:
    """The gateway's ledger, its commits failing with DRIVER_ERROR until `heal`; `healed` is set once a commit
    after it has written rows."""

    def __init__(self, gw: Gateway) -> None:
        self.ledger = gw.app.state.services.ledger
        self.ledger.record_timeout_s = 0.3  # a request waits this long for its row
        self.broken = threading.Event()
        self.broken.set()
        self.healed = threading.Event()
        real = self.ledger._commit

        def commit(conn: Any, rows: list[Any], counts: Any, **kwargs: Any) -> list[Exception | None]:
            if self.broken.is_set():
                raise psycopg.OperationalError(DRIVER_ERROR)
            errors = real(conn, rows, counts, **kwargs)
            if rows:
                self.healed.set()
            return errors

        self.ledger._commit = commit
        is_db_fault = self.ledger._is_db_fault
        # the database's fault, not the row's, as quotas/ledger_postgres.py tells it (the gateway's ledger here is
        # SQLite's, which would otherwise retry the group row by row)
        self.ledger._is_db_fault = lambda exc: isinstance(exc, psycopg.OperationalError) or is_db_fault(exc)

    def heal(self) -> None:
        self.broken.clear()


def _error_of(r: Any, stream: bool) -> dict[str, Any]:
    if not stream:
        return r.json()["error"]
    last = [line for line in r.text.splitlines() if line.startswith("data:")][-1]
    return json.loads(last.removeprefix("data:"))["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_row_the_database_cannot_write_is_a_fixed_503_and_the_fault_stays_with_operators(
        gateway: Gateway, caplog: pytest.LogCaptureFixture, stream: bool) -> None:
    disk = BrokenDisk(gateway)
    with caplog.at_level(logging.WARNING, logger="tiergate"), gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "stream": stream})
        error = _error_of(r, stream)  # a stream has sent its tokens: its last event says the row was not written
        assert r.status_code == (200 if stream else 503), r.text
        if stream:  # the stream's row is billed once written: the event says so, never "retry later"
            assert error["code"] == "usage_recorded_late" and error["message"] == USAGE_LATE_MESSAGE
        else:
            assert error["code"] == "ledger_unavailable" and error["message"] == LEDGER_UNAVAILABLE_MESSAGE
        assert stream or r.headers["retry-after"] == "5"
        assert r.headers["x-tiergate-request-id"]
        assert [s for s in LEAKS if s in r.text] == []
        # the ledger is not ready now: new work is refused, in the same fixed words
        again = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
    assert again.status_code == 503 and again.json()["error"]["code"] == "not_ready", again.text
    assert again.json()["error"]["message"] == NOT_READY_MESSAGE and again.headers["retry-after"] == "5"
    assert [s for s in LEAKS if s in again.text] == []
    assert "10.20.30.40" in caplog.text  # the operator's copy
    with gateway.client(gateway.admin_key) as admin:
        assert "10.20.30.40" in admin.get("/health").json()["ledger"]
    disk.heal()
    if stream:
        assert disk.healed.wait(10)  # the row of the tokens sent is written once the database can take it
        assert [row.request_id for row in gateway.ledger_rows()] == [r.headers["x-tiergate-request-id"]]
        return
    # a JSON answer's row was withdrawn (its client got only the 503): never written, and the ledger is ready again
    # once it can commit, with no row of its own pending (gateway/pipeline/settle.py)
    deadline = time.monotonic() + 10
    while not disk.ledger.ready:
        assert time.monotonic() < deadline, disk.ledger.not_ready_reason
        time.sleep(0.05)
    with gateway.client(gateway.tenant_key) as c:
        ok = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG})
    assert ok.status_code == 200, ok.text
    assert [row.request_id for row in gateway.ledger_rows()] == [ok.headers["x-tiergate-request-id"]]


def test_a_ledger_fault_is_logged_once_not_once_a_request(caplog: pytest.LogCaptureFixture) -> None:
    # every request refused in an outage answers the same fault: one log line for it, another for a new fault
    with caplog.at_level(logging.WARNING, logger="tiergate"):
        for fault in ("disk full at 10.20.30.40",) * 3 + ("server closed the connection",) * 2:
            assert client_error(LedgerUnavailable(fault)).message == LEDGER_UNAVAILABLE_MESSAGE
    logged = [r.getMessage() for r in caplog.records if "ledger_unavailable" in r.getMessage()]
    assert len(logged) == 2 and "10.20.30.40" in logged[0] and "server closed" in logged[1]
