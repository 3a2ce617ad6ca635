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


def test_errors_always_pass() -> None:
    limit = RepeatLimit(every_s=60, clock=Clock())
    errors = [logging.LogRecord("uvicorn.error", logging.ERROR, "httptools_impl.py", 425,
                                "Exception in ASGI application", None, None) for _ in range(5)]
    assert all(limit.filter(r) for r in errors)


def test_an_app_that_raises_is_logged_every_time_traceback_and_all() -> None:
    """The client's lines are limited; the app's own errors, which uvicorn logs from each request's cycle, are not."""
    import httpx

    from gateway import http_limits
    from tests.stubs import ServerThread

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http":
            raise RuntimeError(f"broken on {scope['path']}")

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    server = ServerThread(app, http=http_limits.limited_protocol(30, 60)).start()
    logging.getLogger("uvicorn.error").addHandler(handler)  # after: uvicorn's config drops the logger's handlers
    try:
        for i in range(3):
            assert httpx.get(f"{server.url}/p{i}").status_code == 500
    finally:
        server.stop()
        logging.getLogger("uvicorn.error").removeHandler(handler)
    raised = [r for r in records if r.getMessage().startswith("Exception in ASGI application")]
    assert [str(r.exc_info[1]) for r in raised if r.exc_info] == ["broken on /p0", "broken on /p1", "broken on /p2"]
