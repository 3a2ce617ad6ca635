"""What a loop (or a path every request takes) logs while a store it needs is down: each distinct fault once, then
one line when it works again, not a line (and a traceback) every round of an outage.

A known store fault (Redis, SQLite, PostgreSQL, a socket: `STORE_ERRORS`) is one line without a traceback; any
other exception is a bug, logged with its traceback, once per distinct message in the outage. The ledger's writer
(quotas/ledger.py) and `client_error`'s ledger_unavailable (gateway/errors.py) log the same way.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import threading

import psycopg
from redis.exceptions import RedisError

from quotas.backends.base import QuotaBackendError
from quotas.ledger import LedgerUnavailable

# the faults of a store being down, busy or locked: one line each, no traceback
STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, sqlite3.OperationalError, psycopg.OperationalError,
                                                 QuotaBackendError, LedgerUnavailable, OSError, TimeoutError)
MAX_DISTINCT = 20  # distinct faults logged in one outage; past that, only the recovery line (its count) follows
_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")  # a URL's `user:password@`, should a driver repeat one


def redacted(text: str) -> str:
    """`text` on one line (a driver's message may hold several: its DETAIL and HINT), a URL's password blanked: what a
    log line or an operator's one-line error may say of a store's fault."""
    return _PASSWORD.sub(r"\1***@", " ".join(text.split()))


class FaultLog:
    """`failed(exc)` at each failed round, `ok()` at each round that worked; `rounds` names them in the recovery
    line ("requests" for a path every request takes). Safe to call from several threads (a store's query threads);
    a fault's text is one line, a URL's password blanked (`redacted`)."""

    def __init__(self, log: logging.Logger, what: str, *, known: tuple[type[BaseException], ...] = STORE_ERRORS,
                 level: int = logging.WARNING, rounds: str = "rounds") -> None:
        self.log, self.what, self.known, self.level, self.rounds = log, what, known, level, rounds
        self.failures = 0  # failed rounds since the last that worked
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        fault = redacted(f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.failures += 1
            if fault in self._seen or len(self._seen) >= MAX_DISTINCT:
                return
            self._seen.add(fault)
        if isinstance(exc, self.known):
            self.log.log(self.level, "%s failed (logged once until it works again): %s", self.what, fault)
        else:  # a bug: its traceback
            self.log.error("%s failed", self.what, exc_info=exc)

    def ok(self) -> None:
        if not self.failures:  # the common case, read without the lock
            return
        with self._lock:
            failures, self.failures = self.failures, 0
            self._seen.clear()
        if failures:
            self.log.log(self.level, "%s recovered after %d failed %s", self.what, failures, self.rounds)
