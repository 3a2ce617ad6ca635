"""What the level in force does to one request; each applied action is named for the response headers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.protocol import ChatMessage
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


@dataclass
class Degradation:
    """The level's actions, read once per request, and what they changed."""

    level: int
    actions: list[Action]
    applied: list[str] = field(default_factory=list)

    def _first(self, kind: type) -> Action | None:
        return next((a for a in self.actions if isinstance(a, kind)), None)

    def shed(self, priority: str) -> Shed | None:
        action = self._first(Shed)
        if isinstance(action, Shed) and priority in action.shed:
            self.applied.append(f"shed({priority})")
            return action
        return None

    def cache_only(self, priority: str) -> bool:
        action = self._first(CacheOnly)
        return isinstance(action, CacheOnly) and priority in action.cache_only

    def remap(self, tier: str, usable: Callable[[str], bool]) -> str:
        action = self._first(RemapTiers)
        if isinstance(action, RemapTiers) and tier in action.remap_tiers and usable(action.remap_tiers[tier]):
            target = action.remap_tiers[tier]
            self.applied.append(f"remap_tiers({tier}->{target})")
            return target
        return tier

    def cap_output(self, cap: int) -> int:
        action = self._first(CapOutputTokens)
        if isinstance(action, CapOutputTokens) and cap > action.cap_output_tokens:
            self.applied.append(f"cap_output_tokens({action.cap_output_tokens})")
            return action.cap_output_tokens
        return cap

    def cap_input(self, messages: list[ChatMessage], count: Callable[[list[ChatMessage]], int]) -> list[ChatMessage]:
        """Drop the oldest turns (never the system prompt, never the last message) until the prompt fits."""
        action = self._first(CapInputTokens)
        if not isinstance(action, CapInputTokens) or count(messages) <= action.cap_input_tokens:
            return messages
        kept = list(messages)
        dropped = 0
        while count(kept) > action.cap_input_tokens:
            idx = next((i for i, m in enumerate(kept[:-1]) if m.role not in ("system", "developer")), None)
            if idx is None:
                break
            kept.pop(idx)
            dropped += 1
        if dropped:
            self.applied.append(f"cap_input_tokens({action.cap_input_tokens},dropped={dropped})")
        return kept

    @property
    def shaped_answer(self) -> bool:
        """A cap changed what the model saw or could say: the answer is not the one the request asked for."""
        return any(a.startswith(("cap_input_tokens", "cap_output_tokens")) for a in self.applied)

    @property
    def cascade_disabled(self) -> bool:
        return isinstance(self._first(DisableCascade), DisableCascade)

    @property
    def semantic_threshold_delta(self) -> float:
        action = self._first(LowerSemanticThreshold)
        return action.semantic_threshold_delta if isinstance(action, LowerSemanticThreshold) else 0.0
