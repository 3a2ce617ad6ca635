"""A compute cost is rounded to the picodollar where it is made (tiers/catalogue.py `compute_cost`, quotas/money.py
`round_cost`): it is a division by 3600, which wrote 28 significant digits into every ledger row and printed them in
every report ("0.00000004716677220939244444444444444"). A cost with fewer places is kept as it is."""

from __future__ import annotations

from decimal import Decimal

import pytest

from quotas.money import round_cost
from tiers.catalogue import EmbeddingSpec, TierSpec

TIER = TierSpec(name="mid", backend="openai", model="served-id", urls=["http://x"], price_per_1k_input="0.001",
                price_per_1k_output="0.002", hardware_cost_per_hour="1.00", context_limit=2048)


def places(d: Decimal) -> int:
    exponent = d.as_tuple().exponent
    assert isinstance(exponent, int)
    return max(0, -exponent)


@pytest.mark.parametrize(("busy_s", "cost"), [(0.37, "0.000102777778"), (0.05, "0.000013888889"),
                                              (1e-9, "0"), (0.36, "0.0001"), (3600.0, "1.00"), (0.0, "0")])
def test_a_tiers_compute_cost_has_at_most_12_places(busy_s: float, cost: str) -> None:
    got = TIER.compute_cost(busy_s)
    assert got == Decimal(cost) and places(got) <= 12, got


def test_a_cost_prints_as_12_places_at_most() -> None:
    assert format(TIER.compute_cost(0.37), "f") == "0.000102777778"  # as a report, the CSV or the CLI prints it


def test_an_embedding_cost_has_at_most_12_places() -> None:
    got = EmbeddingSpec().compute_cost(0.0084)  # $0.02 an hour for 8.4 ms: 4.6666...e-8
    assert got == Decimal("0.000000046667") and format(got, "f") == "0.000000046667", got


def test_rounding_is_half_even_and_leaves_short_costs_alone() -> None:
    assert round_cost(Decimal("0.0000000000005")) == 0 and round_cost(Decimal("0.0000000000015")) == Decimal("2E-12")
    assert format(round_cost(Decimal("0.0001")), "f") == "0.0001"  # not padded to 12 places
    assert round_cost(Decimal("12.5")) == Decimal("12.5")
