"""What the level in force does to one request. Each question returns its answer and, where the level
changed something, the action's name for the response's `x-tiergate-degrade-actions` header; nothing here
is written after it is read, so every stage can hold the same `Degradation`.

A remap is bounded by the tenant's plan, as every other route is: the level moves requests off a tier, it never
serves a tier the plan leaves out, nor bills one dearer than the plan agreed to pay. The tier that takes a remapped
request's place (`remap`) is, in order:
1. the remap's target, when the plan allows it and it is cheaper, or dearer but the plan's `allow_upgrade` says the
   tenant pays for a dearer tier when its own cannot serve;
2. else the closest tier cheaper than the remapped one that the plan allows and the level does not remap itself;
3. else none: the request is refused, a 503 with Retry-After naming the level (`RemapRefused`): the level means
   the tier not to be used now, and the plan offers nothing in its place. The 503 names only the remapped tier,
   which the tenant asked for or its plan offers.
A candidate that cannot take the request now (down, or unable to call the request's tools) is passed over; when
every candidate is so, the tier stays: the ladder degrades service, it does not make one tier's outage a refusal
of every request (level 2 enters on `tiers_down`, perhaps because the target is the tier that is down)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from gateway.ladder.config import (
    Action,
    CacheOnly,
    CapInputTokens,
    CapOutputTokens,
    DisableCascade,
    LowerSemanticThreshold,
    RemapTiers,
    Shed,
)


class RemapRefused(Exception):
    """The level remaps a request's tier and the tenant's plan offers no tier to take its place."""

    def __init__(self, level: int, tier: str) -> None:
        super().__init__(f"degradation level {level}: tier {tier!r} is not served now, and your plan offers no "
                         "tier that can take this request in its place; retry later")
        self.level = level
        self.tier = tier
        self.action = f"remap_tiers({tier}->none)"


@dataclass(frozen=True)
class Degradation:
    """The level's actions, read once per request."""

    level: int
    actions: tuple[Action, ...]

    def _first(self, kind: type) -> Action | None:
        return next((a for a in self.actions if isinstance(a, kind)), None)

    def shed(self, priority: str) -> Shed | None:
        action = self._first(Shed)
        return action if isinstance(action, Shed) and priority in action.shed else None

    def cache_only(self, priority: str) -> bool:
        action = self._first(CacheOnly)
        return isinstance(action, CacheOnly) and priority in action.cache_only

    def moves_off(self, tier: str) -> bool:
        """The level remaps requests off `tier`."""
        action = self._first(RemapTiers)
        return isinstance(action, RemapTiers) and tier in action.remap_tiers

    def remap(self, tier: str, *, by_price: Sequence[str], allowed: Collection[str], upgrade: bool,
              usable: Callable[[str], bool]) -> tuple[str, str | None]:
        """The tier to use instead of `tier` (see the module's docstring), and the action's name when it remapped.
        `by_price`: every tier, cheapest first; `allowed`: the plan's tiers for this request; `upgrade`: the plan's
        `allow_upgrade`. Raises `RemapRefused` when the plan offers no tier in its place."""
        action = self._first(RemapTiers)
        if not isinstance(action, RemapTiers) or tier not in action.remap_tiers or tier not in by_price:
            return tier, None
        target, at = action.remap_tiers[tier], by_price.index(tier)
        candidates = [t for t in reversed(by_price[:at]) if t in allowed and not self.moves_off(t)]
        if target in allowed and target in by_price and (by_price.index(target) < at or upgrade):
            candidates = [target, *(t for t in candidates if t != target)]
        if not candidates:
            raise RemapRefused(self.level, tier)
        chosen = next((t for t in candidates if usable(t)), None)
        return (tier, None) if chosen is None else (chosen, f"remap_tiers({tier}->{chosen})")

    def cap_output(self, cap: int) -> tuple[int, str | None]:
        action = self._first(CapOutputTokens)
        if isinstance(action, CapOutputTokens) and cap > action.cap_output_tokens:
            return action.cap_output_tokens, f"cap_output_tokens({action.cap_output_tokens})"
        return cap, None

    @property
    def input_cap(self) -> int | None:
        action = self._first(CapInputTokens)
        return action.cap_input_tokens if isinstance(action, CapInputTokens) else None

    @property
    def cascade_disabled(self) -> bool:
        return isinstance(self._first(DisableCascade), DisableCascade)

    @property
    def semantic_threshold_delta(self) -> float:
        action = self._first(LowerSemanticThreshold)
        return action.semantic_threshold_delta if isinstance(action, LowerSemanticThreshold) else 0.0


NORMAL = Degradation(0, ())


def shaped_answer(applied: Sequence[str]) -> bool:
    """A cap changed what the model saw or could say: the answer is not the one the request asked for."""
    return any(a.startswith(("cap_input_tokens", "cap_output_tokens")) for a in applied)
