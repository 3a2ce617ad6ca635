"""Money as integers: picodollars (1e-12 USD), so counters stay exact in Redis (INCRBY) and in memory.

Per-token prices here go down to about 1e-8 USD, so micro-dollars would round them away; int64 holds
9.2 million dollars of picodollars, far above any daily or monthly counter.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal

from pydantic_core import PydanticCustomError

PICO = Decimal("1e12")
COST_PLACES = Decimal("1e-12")  # a compute cost's precision: one picodollar, the unit money is counted in here
# a price per 1K tokens (a tier's, the embeddings', a plan's cache hit): at most 9 decimal places, so a token's price
# is a whole number of picodollars and every row's price, and any sum of rows, is exact in picodollars: the ledger's
# total, the budget counter (rounded up per row at settle) and a re-seed from the ledger's sums agree. A price of 1e-15
# USD a token was taken, and each rounded it up at a different place (a Redis re-seed lowered the counter)
PRICE_PLACES = 9


def to_pico(usd: Decimal) -> int:
    """Rounded up, so a reservation never undercounts."""
    return int((usd * PICO).to_integral_value(rounding=ROUND_CEILING))


def from_pico(pico: int) -> Decimal:
    return Decimal(pico) / PICO


def round_cost(usd: Decimal) -> Decimal:
    """A compute cost to at most 12 decimal places (COST_PLACES, half-even). A cost is a division (a tier's dollars
    an hour x seconds / 3600) that otherwise carries 28 significant digits into the ledger and every report
    ("0.00000004716677220939244444444444444"); one with fewer places is kept as it is ("0.0001", not padded)."""
    exponent = usd.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -12:  # not NaN or infinite, and finer than a picodollar
        return usd.quantize(COST_PLACES, rounding=ROUND_HALF_EVEN)
    return usd


def whole_picodollars_a_token(price_per_1k: Decimal) -> Decimal:
    """A price per 1K tokens as a config file gives it, refused (naming the rule; the loader names the field) if it has
    more than PRICE_PLACES decimal places: a token's price is then a fraction of a picodollar."""
    exponent = price_per_1k.normalize().as_tuple().exponent  # "0.0010000000000" has 3 places, as pydantic counts
    if isinstance(exponent, int) and exponent < -PRICE_PLACES:
        raise PydanticCustomError(
            "price_places", "a price per 1K tokens has at most {places} decimal places (a token's price a whole number "
            "of picodollars, the unit budgets are counted in): {price} has {given}",
            {"places": PRICE_PLACES, "price": format(price_per_1k, "f"), "given": -exponent})
    return price_per_1k
