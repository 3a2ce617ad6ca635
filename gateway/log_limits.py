"""Log lines a client can cause, bounded: each line of code logs at most once a minute, then says how often it was
dropped.

uvicorn logs a warning for every malformed request ("Invalid HTTP request received.") and every upgrade to a
protocol it does not speak ("Unsupported upgrade request."), before any key is read. One client with no key wrote
5,400-6,700 such lines a second here (40 bytes each: 15-23 GB a day of disk, and the CPU to write it), and the
second kind on a single kept-alive connection. Counting them still tells an operator that it happens and how much.
Only the protocol's own lines go through the limit: a request's cycle logs to uvicorn's logger, so an exception the
app lets out is logged every time, traceback and all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY_S = 60.0  # a line of code logs at most once in this long


class RepeatLimit(logging.Filter):
    """Passes a warning (or less) if its line of code (file and line: a bounded set, whatever the message holds) has
    not passed one in the last `every_s`; the next one that passes after drops says how many were dropped. Errors
    always pass."""

    def __init__(self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._sites: dict[tuple[str, int], tuple[float, int]] = {}  # site -> (last passed at, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:  # an error is never a client's doing to hide
            return True
        site = (record.pathname, record.lineno)
        now = self._clock()
        passed, dropped = self._sites.get(site, (-self.every_s, 0))
        if now - passed < self.every_s:
            self._sites[site] = (passed, dropped + 1)
            return False
        self._sites[site] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like this in the last {now - passed:.0f}s, not logged)"
        return True



def client_logger() -> logging.Logger:
    """The logger uvicorn's protocol logs a client's doings to (gateway/http_limits.py hands it over): a child of
    uvicorn's own, so its lines go where uvicorn's go, through a RepeatLimit."""
    logger = logging.getLogger("uvicorn.error.clients")
    if not any(isinstance(f, RepeatLimit) for f in logger.filters):
        logger.addFilter(RepeatLimit())
    return logger


class WithoutQuery(logging.Filter):
    """uvicorn's access lines with the query string cut (`?…`): a client that sends its key there (`?api_key=…`)
    would have it written into the log of any operator who raises uvicorn's level to see access lines. The path
    stays (the routes hold no secrets)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?…", *args[3:])
        return True


def access_logger() -> logging.Logger:
    """uvicorn's access logger, through WithoutQuery (installed once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, WithoutQuery) for f in logger.filters):
        logger.addFilter(WithoutQuery())
    return logger
