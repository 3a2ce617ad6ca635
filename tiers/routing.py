"""Which tier answers a request, and why (said in `x-tiergate-route-reason` and the ledger).

The rules, in the order they apply:

1. An explicit tier is honoured when the plan allows it (`TierNotAllowed` otherwise, which the gateway answers
   exactly as `UnknownModel`: 404 `model_not_found`, the same words, naming only the plan's tiers: `check_model`).
2. `auto` takes the cheapest allowed tier whose predicted fidelity for this request (from the difficulty
   model: 1.0 is the full tier's answer) reaches the plan's quality floor; the caller has already relaxed
   that floor for a tenant low on budget. With no difficulty model yet, `auto` is the plan's default tier.
   A tier whose prediction is no better than predicting the mean (the artifact says which) cannot be judged
   before it answers: `auto` says so and falls back to the cascade policy from that tier. Under the cascade
   policy (a plan's `policy: cascade`, or that fallback) the cheapest allowed tier answers first and its
   answer stands only when its calibrated confidence keeps the floor; otherwise it is retried once on the
   next dearer tier (gateway/pipeline/cascade.py, both billed). A plan's `cascade: true` checks `auto`'s
   answers the same way whichever policy chose their tier. `Route.cascade` and `Route.floor` carry this.
3. Load and health: a tier that cannot take a request (no healthy replica, or every replica's circuit
   breaker open) or whose predicted queue wait breaks the plan's limit is skipped for the closest cheaper
   allowed tier. A dearer tier is used only where the plan says so (`allow_upgrade` for an unavailable
   tier, `allow_dearer_on_load` for an overloaded one), because the tenant would pay more than `auto` or
   its request chose. An overloaded tier is skipped to a cheaper one only with `shed_to_cheaper`;
   otherwise the request is refused (503 with the wait), as the plan's SLO prefers a refusal to a quietly
   worse answer. Load moves only to a tier with hardware of its own: a tier in the overloaded one's hardware
   group (engines on the same cores, tiers/fleet.py) is skipped even when its own queue is empty, because
   the cores it would run on are the ones that are already behind; shedding there adds no capacity and
   slows both. (A tier that is unavailable frees its hardware, so falling back within its group is fine.)
4. The degradation ladder's remaps apply after this function, in admission: the ladder has the last word, within
   the plan (gateway/ladder/apply.py: a remap never serves a tier the plan leaves out).

This module knows tiers and numbers only; admission turns the plan, the quota backend and the fleet into
its arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tiers.catalogue import TierCatalogue, TierSpec
from tiers.errors import NoTierAvailable, TierNotAllowed, TierOverloaded, UnknownModel

AUTO = "auto"
PREDICT, CASCADE = "predict", "cascade"  # how `auto` picks the first tier: by predicted fidelity, or cheapest first


@dataclass(frozen=True)
class Route:
    tier: TierSpec
    reason: str
    auto: bool = False  # chosen by `auto` (only such routes may cascade to a dearer tier)
    cascade: bool = False  # its (non-streamed) answer is checked and, failing, retried once on a dearer tier
    floor: float | None = None  # the quality floor `auto` worked to; the cascade's calibrated check keeps it


@dataclass(frozen=True)
class RouteRules:
    """What a tenant's plan says about routing, as plain values."""

    allowed: list[str]
    default: str
    allow_upgrade: bool = False  # an unavailable tier may fall back to a dearer one
    shed_to_cheaper: bool = False  # an overloaded tier may fall back to a cheaper one
    dearer_on_load: bool = False  # an overloaded tier may fall back to a dearer one
    max_wait_s: float | None = None  # the plan's queue-wait limit
    quality_floor: float = 0.8
    floor_reason: str = "floor 0.8"  # how the floor came about (budget thresholds), for the reason
    policy: str = PREDICT  # PREDICT (the difficulty model) or CASCADE (cheapest first, checked)
    cascade: bool = False  # the plan checks `auto`'s answers and retries failing ones a tier up


@dataclass(frozen=True)
class Prediction:
    """The difficulty model's answer for one request."""

    fidelity: Mapping[str, float]  # tier name -> predicted fidelity, 0-1
    version: str
    # tier name -> why its prediction is not used: no better than predicting the mean (its CV numbers)
    uninformative: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TierConditions:
    """What the fleet and the dispatch queues say now."""

    unavailable: Mapping[str, str] = field(default_factory=dict)  # tier -> why it cannot take a request
    waits: Mapping[str, float] = field(default_factory=dict)  # tier -> predicted queue wait, seconds
    # tier -> hardware group: tiers in one group run on the same cores (or device); a tier absent has its own
    groups: Mapping[str, str] = field(default_factory=dict)

    def share_hardware(self, a: str, b: str) -> bool:
        return a != b and a in self.groups and self.groups.get(a) == self.groups.get(b)


def choose_tier(requested: str, *, catalogue: TierCatalogue, rules: RouteRules,
                conditions: TierConditions | None = None, prediction: Prediction | None = None,
                unpredicted: str = "no difficulty model yet") -> Route:
    """`unpredicted` says why `prediction` is None (no model yet, a failing one), for the reason."""
    conditions = conditions or TierConditions()
    ordered = [t for t in catalogue.by_price() if t.name in rules.allowed]
    cascade = False
    if requested == AUTO:
        target, reason, cascade = _auto(ordered, rules, prediction, unpredicted)
    else:
        check_model(requested, catalogue=catalogue, allowed=rules.allowed)
        target, reason = requested, "requested"
    is_auto = requested == AUTO
    floor = rules.quality_floor if is_auto else None

    def routed(tier: TierSpec, why: str) -> Route:
        return Route(tier, why, is_auto, cascade, floor)

    problem = _problem(target, rules, conditions, None)
    if problem is None:
        return routed(catalogue.tiers[target], reason)

    unavailable = target in conditions.unavailable
    moving_load_from = None if unavailable else target
    at = next(i for i, t in enumerate(ordered) if t.name == target)
    candidates: list[TierSpec] = []
    if unavailable or rules.shed_to_cheaper:
        candidates += reversed(ordered[:at])  # cheaper, closest first
    if rules.allow_upgrade if unavailable else rules.dearer_on_load:
        candidates += ordered[at + 1:]  # dearer, cheapest first
    prefix = f"{reason}; " if is_auto else ""
    for tier in candidates:
        if _problem(tier.name, rules, conditions, moving_load_from) is None:
            if unavailable:
                return routed(tier, f"{prefix}{target} unavailable ({problem}); fell back to {tier.name}")
            return routed(tier, f"{prefix}{target} {problem}; shed to {tier.name}")

    tried = [target, *(t.name for t in candidates)]
    why = "; ".join(f"{name}: {_problem(name, rules, conditions, moving_load_from)}" for name in tried)
    waits = {name: conditions.waits.get(name, 0.0) for name in tried
             if name not in conditions.unavailable and _overloaded(name, rules, conditions)}
    if waits:
        shortest = min(waits, key=waits.__getitem__)
        head = (f"tier {target!r} is overloaded: predicted wait {waits[target]:.1f}s exceeds your plan's "
                f"{rules.max_wait_s}s" if target in waits else
                f"no tier can serve this request within your plan's {rules.max_wait_s}s wait")
        raise TierOverloaded(f"{head} ({why})", tier=shortest, wait_s=waits[shortest])
    raise NoTierAvailable(f"no tier can serve this request now ({why})")


def check_model(requested: str, *, catalogue: TierCatalogue, allowed: list[str]) -> None:
    """Refuse a model the plan does not offer: `UnknownModel` for a name that is no tier, `TierNotAllowed` for a
    tier the plan leaves out. The tenant reads one answer for both (gateway/errors.py: a 404 with the same
    words, naming only `auto` and the plan's tiers, what /v1/models shows it), after the same work, so it never
    learns the names of tiers its plan does not offer."""
    if requested == AUTO or (requested in allowed and requested in catalogue.tiers):
        return
    offered = ", ".join([AUTO, *(name for name in allowed if name in catalogue.tiers)])
    message = f"the model {requested!r} does not exist or you do not have access to it; your plan offers: {offered}"
    raise TierNotAllowed(message) if requested in catalogue.tiers else UnknownModel(message)


def _auto(ordered: list[TierSpec], rules: RouteRules, prediction: Prediction | None,
          unpredicted: str) -> tuple[str, str, bool]:
    """The cheapest allowed tier predicted to reach the floor (or the cascade's first tier), why, and whether
    its answer is checked by the cascade."""
    if rules.policy == CASCADE and ordered:
        first = ordered[0].name
        return first, f"auto: cascade policy: {first} first, kept if its confidence reaches {rules.floor_reason}", True
    if prediction is None:
        return rules.default, f"auto: {unpredicted}; the plan's default tier", rules.cascade
    scored = [(t.name, prediction.fidelity[t.name]) for t in ordered if t.name in prediction.fidelity]
    model = f"difficulty model {prediction.version}"
    if not scored:
        return rules.default, f"auto: {model} predicts none of the plan's tiers; the plan's default tier", rules.cascade
    for name, fidelity in scored:
        if name in prediction.uninformative:
            return name, (f"auto: {model} cannot predict {name} ({prediction.uninformative[name]}): cascade "
                          f"policy, {name} first, kept if its confidence reaches {rules.floor_reason}"), True
        if fidelity >= rules.quality_floor:
            return (name, f"auto: {name} predicted fidelity {fidelity:.2f} >= {rules.floor_reason} ({model})",
                    rules.cascade)
    best, fidelity = max(reversed(scored), key=lambda s: s[1])  # ties: the dearer one
    return (best, f"auto: no tier reaches {rules.floor_reason}; {best} predicts the most ({fidelity:.2f}, {model})",
            rules.cascade)


def _overloaded(tier: str, rules: RouteRules, conditions: TierConditions) -> bool:
    return rules.max_wait_s is not None and conditions.waits.get(tier, 0.0) > rules.max_wait_s


def _problem(tier: str, rules: RouteRules, conditions: TierConditions, overloaded: str | None) -> str | None:
    """Why `tier` cannot take this request now, or None; `overloaded`: the tier whose load is being moved."""
    if tier in conditions.unavailable:
        return conditions.unavailable[tier]
    if _overloaded(tier, rules, conditions):
        return f"predicted wait {conditions.waits[tier]:.1f}s > {rules.max_wait_s}s"
    if overloaded is not None and conditions.share_hardware(tier, overloaded):
        return f"shares {overloaded}'s hardware ({conditions.groups[tier]}): no capacity of its own"
    return None
