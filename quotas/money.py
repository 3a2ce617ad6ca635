"""Money as integers: picodollars (1e-12 USD), so counters stay exact in Redis (INCRBY) and in memory.

Per-token prices here go down to about 1e-8 USD, so micro-dollars would round them away; int64 holds
9.2 million dollars of picodollars, far above any daily or monthly counter.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal

PICO = Decimal("1e12")


def to_pico(usd: Decimal) -> int:
    """Rounded up, so a reservation never undercounts."""
    return int((usd * PICO).to_integral_value(rounding=ROUND_CEILING))


def from_pico(pico: int) -> Decimal:
    return Decimal(pico) / PICO
