"""Which tier answers a request, and why (said in `x-tiergate-route-reason` and the ledger).

For now: an explicit tier is honoured when the plan allows it; `auto` means the plan's default tier.
An unavailable tier falls back to the closest cheaper allowed tier, and to a dearer one only where
the plan allows upgrades. The cost-aware router replaces `auto`'s rule, not this function's callers.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiers.catalogue import TierCatalogue, TierSpec
from tiers.errors import NoTierAvailable, TierNotAllowed, UnknownModel

AUTO = "auto"


@dataclass(frozen=True)
class Route:
    tier: TierSpec
    reason: str


def choose_tier(requested: str, *, catalogue: TierCatalogue, allowed: list[str], default: str,
                allow_upgrade: bool, unavailable: dict[str, str]) -> Route:
    """`unavailable` maps tier name → why it cannot serve now (not built, no healthy replica)."""
    if requested == AUTO:
        target, reason = default, "auto: the plan's default tier"
    elif requested in catalogue.tiers:
        if requested not in allowed:
            raise TierNotAllowed(f"your plan does not allow tier {requested!r}; it allows {', '.join(allowed)}")
        target, reason = requested, "requested"
    else:
        names = ", ".join([AUTO, *catalogue.tiers])
        raise UnknownModel(f"the model {requested!r} does not exist; this gateway serves: {names}")
    if target not in unavailable:
        return Route(catalogue.tiers[target], reason)

    ordered = [t for t in catalogue.by_price() if t.name in allowed]
    at = next(i for i, t in enumerate(ordered) if t.name == target)
    candidates = list(reversed(ordered[:at]))  # cheaper, closest first
    if allow_upgrade:
        candidates += ordered[at + 1:]  # dearer, cheapest first
    for tier in candidates:
        if tier.name not in unavailable:
            return Route(tier, f"{target} unavailable ({unavailable[target]}); fell back to {tier.name}")
    why = "; ".join(f"{name}: {unavailable[name]}" for name in [target, *(t.name for t in candidates)])
    raise NoTierAvailable(f"no tier can serve this request now ({why})")
