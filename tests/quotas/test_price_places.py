"""A price per 1K tokens has at most 9 decimal places (quotas/money.py PRICE_PLACES): a token's price is then a whole
number of picodollars, so every ledger row's price and every sum of rows is exact, and the ledger's total, the budget
counter (each row rounded up to the picodollar at settle) and a Redis re-seed (the ledger's sums per key, rounded up
per sum: quotas/seed.py `tenant_spend`) agree. A finer price (12 places were taken: 0.000000000007 per 1K, 7e-15 USD a
token) made each round at a different place, and a re-seed lowered the counter; it is refused where the config is
loaded, naming the tier (or plan) and the field."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.config_files import ConfigFileError, load_yaml
from quotas.backends.memory import MemoryBackend
from quotas.ledger import Ledger, LedgerRow
from quotas.money import to_pico
from quotas.plans import Limits, Plan, PlanBook
from quotas.reservations import QuotaService
from quotas.seed import ledger_spend, tenant_spend
from tiers.catalogue import TierCatalogue

TIER = {"backend": "openai", "urls": ["http://127.0.0.1:9"], "model": "m", "context_limit": 4096,
        "price_per_1k_input": "0.001", "price_per_1k_output": "0.002", "hardware_cost_per_hour": "0.5"}


def tiers_file(tmp_path: Path, small: dict[str, object], embeddings: dict[str, object] | None = None) -> Path:
    path = tmp_path / "tiers.yaml"
    data: dict[str, object] = {"tiers": {"small": TIER | small, "mid": TIER}}
    if embeddings is not None:
        data["embeddings"] = embeddings
    path.write_text(json.dumps(data, indent=1))  # JSON is YAML: a price given as a string stays that decimal
    return path


@pytest.mark.parametrize("price", ["0.0000000001", "0.000000000007", 1e-10, "0.1234567891"])
@pytest.mark.parametrize("field", ["price_per_1k_input", "price_per_1k_output"])
def test_a_tier_price_finer_than_9_decimal_places_is_refused_naming_the_tier_and_field(
        tmp_path: Path, field: str, price: object) -> None:
    path = tiers_file(tmp_path, {field: price})
    with pytest.raises(ConfigFileError) as refused:
        load_yaml(path, TierCatalogue)
    message = str(refused.value)
    assert message.startswith(f"{path}:") and f"tiers.small.{field}: a price per 1K tokens has at most 9 decimal " \
        "places" in message, message
    assert refused.value.line is not None  # the line of the price


def test_the_embeddings_price_finer_than_9_decimal_places_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match=r"embeddings\.price_per_1k_input: a price per 1K tokens has at most 9"):
        load_yaml(tiers_file(tmp_path, {}, {"price_per_1k_input": "0.0000000001"}), TierCatalogue)


def test_a_plans_cache_hit_price_finer_than_9_decimal_places_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plans.yaml"
    plan = {"allowed_tiers": ["mid"], "default_tier": "mid", "cache": {"hit_price_per_1k": "0.0000000001"}}
    path.write_text(json.dumps({"default_plan": "p", "plans": {"p": plan}}))
    with pytest.raises(ConfigFileError, match=r"plans\.p\.cache\.hit_price_per_1k: a price per 1K tokens has at most"):
        load_yaml(path, PlanBook, context={"tiers": {"mid"}})


def test_9_decimal_places_and_trailing_zeros_are_taken(tmp_path: Path) -> None:
    catalogue = load_yaml(tiers_file(tmp_path, {"price_per_1k_input": "0.000000001",
                                                "price_per_1k_output": "0.1234567890000"}), TierCatalogue)
    small = catalogue.tiers["small"]
    assert small.price_per_1k_input == Decimal("1e-9") and small.price(1, 1) == Decimal("0.000123456790")


async def test_ledger_total_budget_counter_and_re_seed_agree_at_9_decimal_places(tmp_path: Path) -> None:
    small = load_yaml(tiers_file(tmp_path, {"price_per_1k_input": "0.000000007",
                                            "price_per_1k_output": "0.123456789"}), TierCatalogue).tiers["small"]
    quotas = QuotaService(MemoryBackend())
    plan = Plan(allowed_tiers=["small"], default_tier="small", limits=Limits(budget_day_usd=Decimal("10")))
    key_limits = Limits(budget_day_usd=Decimal("10"))  # each key a scope of its own: the re-seed sums per key
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    try:
        now = time.time()
        for i, (key, tokens_in, tokens_out) in enumerate([("k1", 7, 3), ("k2", 1, 1), ("k1", 13, 0), ("k2", 0, 11),
                                                          ("k1", 999, 1), ("k2", 3, 7)]):
            price = small.price(tokens_in, tokens_out)
            _, reservation = await quotas.reserve(request_id=f"r{i}", tenant="acme", plan=plan, key_id=key,
                                                  key_limits=key_limits, tokens=tokens_in + tokens_out, price=price,
                                                  dated_at=now)
            assert reservation is not None
            await ledger.record(LedgerRow(request_id=f"r{i}", ts=now, tenant="acme", key_id=key, tier="small",
                                          model="m", status="ok", http_status=200, input_tokens=tokens_in,
                                          output_tokens=tokens_out, price_usd=price, compute_cost_usd=Decimal(0),
                                          cost_basis="none", ttft_s=None, total_s=0.1))
            await quotas.settle(reservation, tokens=tokens_in + tokens_out, price=price)
        total = sum(row.price_usd for row in ledger.rows())
        pico = to_pico(total)
        assert Decimal(pico) / 10**12 == total  # exact: no fraction of a picodollar anywhere
        counted = await quotas.backend.spent("acme", ["t", "k:k1", "k:k2"], now)
        reseeded = tenant_spend(ledger, "acme", now)
        seeded = ledger_spend(ledger, now)
        assert counted["t"] == (pico, pico) and (reseeded["t"].day_pico, reseeded["t"].month_pico) == (pico, pico)
        assert seeded[("acme", "t")].day_pico == pico
        for key in ("k1", "k2"):
            own = to_pico(sum(row.price_usd for row in ledger.rows() if row.key_id == key))
            assert counted[f"k:{key}"][0] == reseeded[f"k:{key}"].day_pico == seeded[("acme", f"k:{key}")].day_pico \
                == own
    finally:
        ledger.close()
