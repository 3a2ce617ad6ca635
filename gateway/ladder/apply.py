"""What the level in force does to one request. Each question returns its answer and, where the level
changed something, the action's name for the response's `x-tiergate-degrade-actions` header; nothing here
is written after it is read, so every stage can hold the same `Degradation`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

    def remap(self, tier: str, usable: Callable[[str], bool]) -> tuple[str, str | None]:
        """The tier to use instead of `tier`, and the action's name when it remapped."""
        action = self._first(RemapTiers)
        if isinstance(action, RemapTiers) and tier in action.remap_tiers and usable(action.remap_tiers[tier]):
            target = action.remap_tiers[tier]
            return target, f"remap_tiers({tier}->{target})"
        return tier, None

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
