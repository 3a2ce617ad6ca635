"""quotas/fault_log.py: each distinct fault once (a store's without traceback, a bug's with), the recovery line."""

from __future__ import annotations

import logging
import sqlite3

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from quotas.fault_log import MAX_DISTINCT, FaultLog

log = logging.getLogger("tiergate.test")


def test_faults_alternating_in_an_outage_are_each_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    faults = FaultLog(log, "the loop")
    with caplog.at_level(logging.INFO, logger="tiergate"):
        for i in range(30):  # refused, then locked, in turn
            faults.failed(RedisConnectionError("refused") if i % 2 else sqlite3.OperationalError("database is locked"))
        faults.ok()
        faults.ok()
        faults.failed(RedisConnectionError("refused"))  # a new outage: logged again
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["the loop failed (logged once until it works again): OperationalError: database is locked",
                        "the loop failed (logged once until it works again): ConnectionError: refused",
                        "the loop recovered after 30 failed rounds",
                        "the loop failed (logged once until it works again): ConnectionError: refused"]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_bug_keeps_its_traceback_and_distinct_faults_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    faults = FaultLog(log, "the loop")
    with caplog.at_level(logging.INFO, logger="tiergate"):
        for i in range(3 * MAX_DISTINCT):
            faults.failed(ValueError(f"bug {i % (2 * MAX_DISTINCT)}"))
    assert len(caplog.records) == MAX_DISTINCT
    assert all(r.levelno == logging.ERROR and r.exc_info is not None for r in caplog.records)


def test_a_url_password_in_a_fault_is_blanked_in_its_line(caplog: pytest.LogCaptureFixture) -> None:
    """Every store's fault line goes through `redacted` (the CLI's one-line errors, the admin pool's and the ladder's
    too): a driver repeating its connection URL never puts the password in the log."""
    faults = FaultLog(logging.getLogger("tiergate.test"), "the store")
    with caplog.at_level(logging.WARNING, logger="tiergate.test"):
        faults.failed(OSError("cannot reach postgresql://tiergate:s3cret@db:5432/fleet\nDETAIL: refused"))
    assert "s3cret" not in caplog.text and "postgresql://tiergate:***@db:5432/fleet DETAIL: refused" in caplog.text
