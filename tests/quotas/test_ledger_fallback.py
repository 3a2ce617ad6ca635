"""Rows settled on a quota fallback carry their mark in the SQLite ledger: a ledger of the previous release gains
the column and the table of rows applied in place, and marked rows are found until noted applied (see
quotas/backends/failover.py; the Postgres ledger's migration: tests/quotas/test_fleet_db.py)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from quotas.ledger import Ledger
from quotas.ledger_rows import INSERT, SCHEMA, LedgerRow, to_db
from quotas.money import from_pico
from tests.quotas.test_ledger import row


def marked(request_id: str, pico: int, mark: str) -> LedgerRow:
    out = row(0, price=str(from_pico(pico)))
    out.request_id, out.ts, out.fallback = request_id, time.time(), mark
    return out


def test_a_ledger_of_the_previous_release_gains_the_mark_in_place(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    old = SCHEMA.replace(",\n    fallback TEXT", "")
    assert old != SCHEMA
    conn = sqlite3.connect(path)
    conn.executescript(old)
    conn.execute("INSERT INTO requests(request_id, ts, tenant, key_id, status, http_status, input_tokens, "
                 "output_tokens, price_usd, compute_cost_usd, cost_basis, total_s) VALUES ('old', ?, 'acme', 'k', "
                 "'ok', 200, 1, 1, '0.5', '0', 'none', 0.1)", (time.time(),))
    conn.commit()
    conn.close()
    ledger = Ledger(path)
    try:
        assert ledger.get("old") is not None and ledger.get("old").fallback is None  # type: ignore[union-attr]
        ledger.record_now([marked("new", 40, "sum:20261205:t,k:k")])
        assert ledger.fallback_pending(0, 10) == [("new", "acme", from_pico(40), "sum:20261205:t,k:k")]
        ledger.mark_fallback_applied(["new"])
        ledger.mark_fallback_applied(["new"])
        assert ledger.fallback_pending(0, 10) == []
    finally:
        ledger.close()
    reopened = Ledger(path)  # a second start changes nothing
    assert reopened.fallback_pending(0, 10) == [] and reopened.get("new").fallback == "sum:20261205:t,k:k"  # type: ignore[union-attr]
    reopened.close()


def read_steps(ledger: Ledger) -> int:
    """SQLite's virtual-machine steps for one read of the pending rows: the work it does, whatever the disk cache."""
    conn = ledger._reader()  # type: ignore[attr-defined]  # the connection this thread's reads use
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    conn.set_progress_handler(step, 1)
    try:
        assert [found[0] for found in ledger.fallback_pending(0, 10)] == ["pending"]
    finally:
        conn.set_progress_handler(None, 1)
    return steps


def test_rows_noted_applied_cost_the_pending_read_nothing(tmp_path: Path) -> None:
    """Every reaper round reads the pending rows: its work follows the rows still pending, not the history."""
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    try:
        ledger.record_now([marked("pending", 40, "sum:20261205:t")])
        for batch, n in (("a", 10), ("b", 3000)):
            ids = [f"{batch}{i}" for i in range(n)]
            ledger.record_now([marked(rid, 40, "sum:20261205:t") for rid in ids])
            ledger.mark_fallback_applied(ids)
            if batch == "a":
                few = read_steps(ledger)
        assert read_steps(ledger) == few
        with sqlite3.connect(tmp_path / "ledger.sqlite3") as conn:
            assert conn.execute("SELECT request_id FROM fallback_pending").fetchall() == [("pending",)]
    finally:
        ledger.close()


# the fallback tables of the release before the list of pending rows
PREVIOUS_FALLBACK_SCHEMA = """
CREATE TABLE fallback_applied (request_id TEXT PRIMARY KEY);
CREATE INDEX requests_fallback ON requests(ts) WHERE fallback IS NOT NULL;
"""


def test_a_ledger_of_the_release_before_carries_its_pending_rows_over(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA + PREVIOUS_FALLBACK_SCHEMA)
    conn.executemany(INSERT, [to_db(marked(rid, 40, "sum:20261205:t")) for rid in ("applied", "pending")])
    conn.execute("INSERT INTO fallback_applied VALUES ('applied')")
    conn.commit()
    conn.close()
    ledger = Ledger(path)
    try:
        assert ledger.fallback_pending(0, 10) == [("pending", "acme", from_pico(40), "sum:20261205:t")]
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT request_id FROM fallback_pending").fetchall() == [("pending",)]
        ledger.mark_fallback_applied(["pending"])
    finally:
        ledger.close()
    reopened = Ledger(path)  # a second start carries nothing over again
    try:
        assert reopened.fallback_pending(0, 10) == []
    finally:
        reopened.close()
