"""The ledger: grouped commits, durable before `record` returns, exact money, totals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from decimal import Decimal
from pathlib import Path

from quotas.ledger import Ledger, LedgerRow
from quotas.report import usage_report


def row(i: int, tenant: str = "acme", tier: str = "mid", price: str = "0.000001") -> LedgerRow:
    return LedgerRow(request_id=f"r{i}", ts=1000.0 + i, tenant=tenant, key_id="k", tier=tier, model="m",
                     status="ok", http_status=200, input_tokens=10, output_tokens=5, price_usd=Decimal(price),
                     compute_cost_usd=Decimal("0.0000001"), cost_basis="engine", ttft_s=0.1, total_s=0.2)


def test_concurrent_records_are_grouped_and_all_durable(tmp_path: Path) -> None:
    async def main() -> None:
        ledger = Ledger(tmp_path / "ledger.db")
        ledger.start()
        await asyncio.gather(*(ledger.record(row(i, tier=["mid", "full"][i % 2])) for i in range(500)))
        ledger.close()

    asyncio.run(main())
    ledger = Ledger(tmp_path / "ledger.db")
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
    from quotas.ledger import Ledger
    from tests.quotas.test_ledger import row

    async def main():
        ledger = Ledger(Path(sys.argv[1]))
        ledger.start()
        i = 0
        while True:
            await asyncio.gather(*(ledger.record(row(i + j)) for j in range(3)))
            for j in range(3):
                print(f"r{i + j}", flush=True)  # acknowledged to the "client" only after the row is durable
            i += 3

    asyncio.run(main())
""")


def test_a_killed_writer_loses_no_acknowledged_row(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2], env=os.environ.copy())
    acked = [proc.stdout.readline().strip() for _ in range(60)]  # type: ignore[union-attr]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ledger = Ledger(db)
    stored = {r.request_id for r in ledger.rows()}
    ledger.close()
    assert set(acked) <= stored
