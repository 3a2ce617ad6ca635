"""Usage reports: grouping, exact money, per-1K figures, savings and refusals."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from quotas.ledger import Ledger, LedgerRow, Refusal
from quotas.report import jsonable, usage_report

DAY1, DAY2 = 1_800_000_000.0, 1_800_000_000.0 + 86400


def row(rid: str, tenant: str, tier: str, ts: float, price: str, cost: str, *, cache: str | None = None,
        cache_saving: str = "0", route_saving: str = "0") -> LedgerRow:
    return LedgerRow(rid, ts, tenant, "k1", tier, "m", "ok", 200, 600, 400, Decimal(price), Decimal(cost), "engine",
                     0.1, 0.2, cache_status=cache, cache_saving_usd=Decimal(cache_saving),
                     route_saving_usd=Decimal(route_saving))


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.record_now([
        row("a", "acme", "full", DAY1, "0.0006", "0.0001"),
        row("b", "acme", "full", DAY2, "0.0004", "0.0001", cache="hit", cache_saving="0.0002"),
        row("c", "acme", "mid", DAY1, "0.0001", "0.00003", route_saving="0.0005"),
        row("d", "globex", "mid", DAY1, "0.0002", "0.00005"),
    ], refusals=[Refusal(f"x{i}", DAY1 + i, tenant, "k1", reason, 429) for i, (tenant, reason) in enumerate(
        [("acme", "rate_limit_rpm"), ("acme", "rate_limit_rpm"), ("acme", "insufficient_quota")])])
    return ledger


def test_by_tenant_and_tier(ledger: Ledger) -> None:
    rows = {(r["tenant"], r["tier"]): r for r in usage_report(ledger, by=("tenant", "tier"))}
    full = rows["acme", "full"]
    assert full["requests"] == 2 and full["input_tokens"] == 1200 and full["output_tokens"] == 800
    assert full["price_usd"] == Decimal("0.0010") and full["compute_cost_usd"] == Decimal("0.0002")
    assert full["margin_usd"] == Decimal("0.0008")
    assert full["price_per_1k_usd"] == Decimal("0.000500000") and full["cost_per_1k_usd"] == Decimal("0.000100000")
    assert full["cache_hits"] == 1 and full["cache_savings_usd"] == Decimal("0.0002")
    assert rows["acme", "mid"]["routed_down"] == 1 and rows["acme", "mid"]["routing_savings_usd"] == Decimal("0.0005")
    assert rows["acme", None]["refusals"] == {"rate_limit_rpm": 2, "insufficient_quota": 1}
    assert rows["acme", None]["requests"] == 0


def test_by_day_filters_and_tenant(ledger: Ledger) -> None:
    rows = usage_report(ledger, by=("tenant", "day"), tenant="acme")
    assert [(r["day"], r["requests"], r["refusals"]) for r in rows] == [
        ("2027-01-15", 2, {"rate_limit_rpm": 2, "insufficient_quota": 1}), ("2027-01-16", 1, {})]
    assert usage_report(ledger, by=("tenant",), since=DAY2)[0]["price_usd"] == Decimal("0.0004")
    total = sum((r["price_usd"] for r in usage_report(ledger, by=("tenant",))), Decimal(0))
    assert total == sum((r.price_usd for r in ledger.rows()), Decimal(0)) == Decimal("0.0013")
    with pytest.raises(ValueError):
        usage_report(ledger, by=("planet",))



def batches_read(ledger: Ledger, monkeypatch: pytest.MonkeyPatch, size: int) -> list[int]:
    """The sizes of the batches the ledger's streamed reads fetch from now on (READ_BATCH set to `size`)."""
    import quotas.ledger_reads as reads_module

    monkeypatch.setattr(reads_module, "READ_BATCH", size)
    sizes: list[int] = []
    stream = ledger._stream

    def counted(*args: object) -> object:
        for batch in stream(*args):  # type: ignore[arg-type]
            sizes.append(len(batch))
            yield batch

    monkeypatch.setattr(ledger, "_stream", counted)
    return sizes


def test_a_report_reads_the_ledger_a_batch_at_a_time(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = usage_report(ledger, by=("tenant", "tier"))
    sizes = batches_read(ledger, monkeypatch, 3)
    monkeypatch.setattr(ledger, "rows", lambda **_: pytest.fail("the report read every row into one list"))
    assert usage_report(ledger, by=("tenant", "tier")) == whole
    assert sizes == [3, 1]
    first = next(ledger.each_row())  # taken as they are read: one batch fetched for the first row
    assert first.request_id == "a" and sizes == [3, 1, 3]


def test_json_money_is_plain_digits_as_in_the_csv(tmp_path: Path) -> None:
    """An embeddings request of 6 tokens at $0.00001 per 1K costs $6E-8: `/v1/usage` wrote "6E-8" (str of the
    Decimal) where the CSV and the CLI write "0.00000006"."""
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.record_now([row("a", "acme", "embeddings", DAY1, "0.00000006", "0.00000004716677220939244444444444444")])
    (got,) = jsonable(usage_report(ledger, by=("tenant", "tier")))
    assert got["price_usd"] == "0.00000006"
    assert got["compute_cost_usd"] == "0.000000047167"  # a row stored unrounded still reads, its sum to 12 places
    assert all("E" not in v for v in got.values() if isinstance(v, str))
    assert Decimal(got["price_usd"]) == Decimal("6E-8")
