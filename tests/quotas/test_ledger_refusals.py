"""Refusals in the ledger are counts, not rows: a flood makes a few rows, old counts expire (SQLite and
PostgreSQL), and a SQLite ledger from before keeps its totals."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from quotas.ledger import Ledger, Refusal
from quotas.report import usage_report
from tests.postgres import LedgerStore
from tests.quotas.test_ledger import row

MINUTE = 1_800_000_000.0  # the start of a minute
DAY_S = 86400.0


async def test_a_flood_of_refusals_makes_a_few_rows_with_the_same_totals(ledger_store: LedgerStore) -> None:
    ledger = ledger_store.open()
    ledger.start()
    for i in range(100_000):  # two minutes of one key's rate-limit refusals, and a few budget refusals
        reason, status = ("insufficient_quota", 402) if i % 10_000 == 0 else ("rate_limit_rpm", 429)
        ledger.submit_refusal(Refusal(f"x{i}", MINUTE + i * 120 / 100_000, "acme", "k1", reason, status))
    await ledger.record(row(0))  # counts submitted before a row are durable with it
    counts = ledger.refusal_counts()
    assert len(counts) == 4 and sum(c.count for c in counts) == 100_000
    assert ledger_store.sql("SELECT COUNT(*) FROM refusal_counts") == [(4,)]
    (acme,) = [r for r in usage_report(ledger, by=("tenant",)) if r["tenant"] == "acme"]
    assert acme["refusals"] == {"rate_limit_rpm": 99_990, "insufficient_quota": 10}
    assert sum(c.count for c in ledger.refusal_counts(since=MINUTE + 60)) == 50_000
    ledger.close()


async def test_a_refusal_is_written_without_a_row_to_carry_it(ledger_store: LedgerStore) -> None:
    ledger = ledger_store.open()
    ledger.start()
    ledger.submit_refusal(Refusal("x", MINUTE, "acme", "k1", "rate_limit_rpm", 429))
    async with asyncio.timeout(10):
        while not ledger.refusal_counts():
            await asyncio.sleep(0.01)
    assert [(c.reason, c.count) for c in ledger.refusal_counts()] == [("rate_limit_rpm", 1)]
    ledger.close()


async def test_counts_older_than_the_retention_are_deleted_at_most_hourly(ledger_store: LedgerStore) -> None:
    now = time.time()
    ledger = ledger_store.open(refusal_retention_days=90)
    ledger.record_now([], refusals=[Refusal("old", now - 91 * DAY_S, "acme", "k1", "rate_limit_rpm", 429),
                                    Refusal("kept", now - 89 * DAY_S, "acme", "k1", "rate_limit_rpm", 429)])
    ledger.start()
    ledger.submit_refusal(Refusal("new", now, "acme", "k1", "rate_limit_rpm", 429))
    await ledger.record(row(0))
    assert [c.minute < now - 90 * DAY_S for c in ledger.refusal_counts()] == [False, False]
    ledger.record_now([], refusals=[Refusal("old2", now - 95 * DAY_S, "acme", "k1", "rate_limit_rpm", 429)])
    ledger.submit_refusal(Refusal("new2", now, "acme", "k1", "rate_limit_rpm", 429))
    await ledger.record(row(1))
    assert sum(c.count for c in ledger.refusal_counts()) == 4  # the next pruning is an hour away
    ledger.close()


OLD_SCHEMA = """
CREATE TABLE refusals (
    request_id TEXT PRIMARY KEY,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    http_status INTEGER NOT NULL
);
CREATE INDEX refusals_ts ON refusals(ts);
"""


def test_a_ledger_from_before_folds_its_refusal_rows_into_counts_once(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    old = sqlite3.connect(db)
    old.execute("PRAGMA journal_mode=WAL")
    old.executescript(OLD_SCHEMA)
    refused = [(MINUTE + 5, "acme", "k1", "rate_limit_rpm"), (MINUTE + 59, "acme", "k1", "rate_limit_rpm"),
               (MINUTE + 60, "acme", "k1", "rate_limit_rpm"), (MINUTE + 7, "acme", "k2", "insufficient_quota"),
               (MINUTE + DAY_S, "acme", "k1", "rate_limit_rpm"), (MINUTE + 1, "globex", "g1", "rate_limit_rpm")]
    with old:
        old.executemany("INSERT INTO refusals VALUES (?, ?, ?, ?, ?, 429)",
                        [(f"x{i}", *r) for i, r in enumerate(refused)])
    old.close()
    ledger = Ledger(db)
    by_day = [(r["tenant"], r["day"], r["refusals"]) for r in usage_report(ledger, by=("tenant", "day"))]
    assert by_day == [("acme", "2027-01-15", {"rate_limit_rpm": 3, "insufficient_quota": 1}),
                      ("acme", "2027-01-16", {"rate_limit_rpm": 1}), ("globex", "2027-01-15", {"rate_limit_rpm": 1})]
    assert sorted((c.minute - MINUTE, c.key_id, c.count) for c in ledger.refusal_counts(tenant="acme")) == [
        (0, "k1", 2), (0, "k2", 1), (60, "k1", 1), (DAY_S, "k1", 1)]
    ledger.close()
    again = Ledger(db)  # opened again: nothing folded twice
    assert sum(c.count for c in again.refusal_counts()) == len(refused)
    assert again._read.execute("SELECT name FROM sqlite_master WHERE name = 'refusals'").fetchone() is None
    again.close()
