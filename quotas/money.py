"""Money as integers: picodollars (1e-12 USD), so counters stay exact in Redis (INCRBY) and in memory.

Per-token prices here go down to about 1e-8 USD, so micro-dollars would round them away; int64 holds
9.2 million dollars of picodollars, far above any daily or monthly counter.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal

PICO = Decimal("1e12")
COST_PLACES = Decimal("1e-12")  # a compute cost's precision: one picodollar, the unit money is counted in here


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
