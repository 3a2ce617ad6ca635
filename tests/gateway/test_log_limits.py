"""RepeatLimit (gateway/log_limits.py): a line of code logs at most once a period, then says how much it dropped."""

from __future__ import annotations

import logging

from gateway.log_limits import RepeatLimit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(msg: str, lineno: int) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error.clients", logging.WARNING, "httptools_impl.py", lineno, msg, None, None)


def test_a_line_of_code_passes_once_a_period_and_then_counts_what_it_dropped() -> None:
    clock = Clock()
    limit = RepeatLimit(every_s=60, clock=clock)
    assert limit.filter(_record("Invalid HTTP request received.", 176))
    assert not any(limit.filter(_record("Invalid HTTP request received.", 176)) for _ in range(999))
    assert limit.filter(_record("Unsupported upgrade request.", 160))  # another line of code is its own
    clock.now += 59.9
    assert not limit.filter(_record("Invalid HTTP request received.", 176))
    clock.now += 0.2
    record = _record("Invalid HTTP request received.", 176)
    assert limit.filter(record)
    assert record.getMessage() == "Invalid HTTP request received. (1000 more like this in the last 60s, not logged)"
    clock.now += 61
    quiet = _record("Invalid HTTP request received.", 176)
    assert limit.filter(quiet) and quiet.getMessage() == "Invalid HTTP request received."


def test_what_a_message_holds_does_not_make_it_new() -> None:
    limit = RepeatLimit(every_s=60, clock=Clock())
    passed = [limit.filter(_record(f"client {i} said something", 42)) for i in range(100)]
    assert passed.count(True) == 1
