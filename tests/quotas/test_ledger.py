"""The ledger: grouped commits, durable before `record` returns, exact money, totals; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from decimal import Decimal
from pathlib import Path

import pytest

from quotas.ledger import Ledger, LedgerRow
from quotas.report import usage_report
from tests.postgres import LedgerStore


def row(i: int, tenant: str = "acme", tier: str = "mid", price: str = "0.000001") -> LedgerRow:
    return LedgerRow(request_id=f"r{i}", ts=1000.0 + i, tenant=tenant, key_id="k", tier=tier, model="m",
                     status="ok", http_status=200, input_tokens=10, output_tokens=5, price_usd=Decimal(price),
                     compute_cost_usd=Decimal("0.0000001"), cost_basis="engine", ttft_s=0.1, total_s=0.2)


def test_concurrent_records_are_grouped_and_all_durable(ledger_store: LedgerStore) -> None:
    async def main() -> None:
        ledger = ledger_store.open()
        ledger.start()
        await asyncio.gather(*(ledger.record(row(i, tier=["mid", "full"][i % 2])) for i in range(500)))
        ledger.close()

    asyncio.run(main())
    ledger = ledger_store.open()
    rows = ledger.rows()
    assert len(rows) == 500 and len({r.request_id for r in rows}) == 500
    totals = {t["tier"]: t for t in usage_report(ledger, by=("tier",))}
    # 250 × 0.000001 exactly: no float drift
    assert totals["mid"]["price_usd"] == Decimal("0.000250") and totals["full"]["requests"] == 250
    assert ledger.get("r7").price_usd == Decimal("0.000001")
    ledger.close()


WRITER = textwrap.dedent("""
    import asyncio, sys
    from decimal import Decimal
    from pathlib import Path
    from tests.postgres import open_ledger_at
    from tests.quotas.test_ledger import row

    async def main():
        ledger = open_ledger_at(sys.argv[1])
        ledger.start()
        i = 0
        while True:
            await asyncio.gather(*(ledger.record(row(i + j)) for j in range(3)))
            for j in range(3):
                print(f"r{i + j}", flush=True)  # acknowledged to the "client" only after the row is durable
            i += 3

    asyncio.run(main())
""")


def test_a_killed_writer_loses_no_acknowledged_row(ledger_store: LedgerStore) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, ledger_store.target], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2], env=os.environ.copy())
    acked = [proc.stdout.readline().strip() for _ in range(60)]  # type: ignore[union-attr]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ledger = ledger_store.open()
    stored = {r.request_id for r in ledger.rows()}
    ledger.close()
    assert set(acked) <= stored


def test_the_sync_setting_chooses_how_durable_a_commit_is(tmp_path: Path) -> None:
    """SQLite's: normal (the default) commits to the OS, which the SIGKILL test above shows is enough for a killed
    gateway; full waits for the disk at every commit as well."""
    seen: dict[str, int] = {}

    async def write(sync: str) -> None:
        def probe(conn: sqlite3.Connection) -> None:
            seen[sync] = conn.execute("PRAGMA synchronous").fetchone()[0]

        ledger = Ledger(tmp_path / f"{sync}.db", sync=sync, on_connect=probe)  # type: ignore[arg-type]
        ledger.start()
        await ledger.record(row(1))
        ledger.close()

    for sync in ("normal", "full"):
        asyncio.run(write(sync))
    assert seen == {"normal": 1, "full": 2}  # SQLite's NORMAL and FULL
    with pytest.raises(ValueError):
        Ledger(tmp_path / "x.db", sync="off")  # type: ignore[arg-type]
