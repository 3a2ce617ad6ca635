"""Rows settled on a quota fallback carry their mark in the SQLite ledger: a ledger of the previous release gains
the column and the table of rows applied in place, and marked rows are found until noted applied (see
quotas/backends/failover.py; the Postgres ledger's migration: tests/quotas/test_fleet_db.py)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from quotas.ledger import Ledger
from quotas.ledger_rows import SCHEMA, LedgerRow
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
