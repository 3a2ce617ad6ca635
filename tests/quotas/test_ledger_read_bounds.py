"""The ledger's reads on PostgreSQL are bounded (quotas/ledger_reads.py READ_TIMEOUT_S): a read that cannot finish (a
report's sum over a huge range, a read waiting on an operator's LOCK TABLE) is cancelled after the bound, in the
gateway's read pool and in a report process's reader alike, instead of holding its connection (one of the pool's
few, or the report process) without end. The pool's connection is free again after it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from quotas import ledger_postgres
from quotas.ledger_postgres import PostgresLedger
from quotas.ledger_reads import ReadSource, open_reader
from tests.quotas.test_ledger import row


def ended_with(read: Callable[[], Any], bound_s: float = 10.0) -> BaseException | None:
    """What `read` raised, or None if it returned; a read still running after `bound_s` fails the test (it hung)."""
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            read()
            ended.append(None)
        except BaseException as exc:  # what the read ended with is the test's
            ended.append(exc)

    reading = threading.Thread(target=run, daemon=True)
    reading.start()
    reading.join(bound_s)
    assert ended, f"the read was still waiting after {bound_s:g} s"
    return ended[0]


@pytest.mark.parametrize("where", ["pool", "reader"])
def test_a_read_waiting_on_a_lock_is_cancelled_after_the_bound(database_url: str, monkeypatch: pytest.MonkeyPatch,
                                                               where: str) -> None:
    monkeypatch.setattr(ledger_postgres, "READ_TIMEOUT_S", 0.3, raising=False)
    ledger = PostgresLedger(database_url, max_read_connections=1)
    ledger.record_now([row(1)])
    reads = ledger if where == "pool" else open_reader(ReadSource("postgres", database_url))
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
        try:
            assert isinstance(ended_with(reads.rows), psycopg.errors.QueryCanceled)
            assert isinstance(ended_with(lambda: reads.request_totals(["tenant"])), psycopg.errors.QueryCanceled)
        finally:
            blocker.rollback()
        assert [r.request_id for r in reads.rows()] == ["r1"]  # the connection serves the next read
    finally:
        blocker.close()
        if reads is not ledger:
            reads.close()  # type: ignore[union-attr]
        ledger.close()
