"""`degrade_ladder.yaml`: ordered levels, what each does to a request, and when it switches by itself.

Read with the tiers file's names as the validation context (`{"tiers": names}`, see `load_ladder`), a remap
naming a tier that file does not have, or mapping a tier to itself, is refused with the file's line: a misspelt
tier would otherwise make the remap do nothing, silently, on the day it is needed."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from gateway.config_files import load_yaml

PriorityClass = Literal["interactive", "standard", "batch"]
Metric = Literal["queue_wait_p95_s", "error_rate", "tiers_down", "redis_down", "kv_utilisation"]
MAX_THRESHOLD_DROP = 0.05  # the semantic cache's threshold may be lowered at most this much


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RemapTiers(_Action):
    remap_tiers: Annotated[dict[str, str], Field(min_length=1)]  # e.g. {full: mid}

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> RemapTiers:
        if same := sorted(k for k, v in self.remap_tiers.items() if k == v):
            raise ValueError(f"remap_tiers maps {', '.join(map(repr, same))} to itself")
        known = (info.context or {}).get("tiers")
        if known is not None:
            unknown = sorted({*self.remap_tiers, *self.remap_tiers.values()} - set(known))
            if unknown:
                raise ValueError(f"remap_tiers names unknown tiers {unknown}; the tiers file has {sorted(known)}")
        return self


class CapOutputTokens(_Action):
    cap_output_tokens: Annotated[int, Field(ge=1)]


class CapInputTokens(_Action):
    cap_input_tokens: Annotated[int, Field(ge=16)]  # drop the oldest turns, keeping the system prompt


class CacheOnly(_Action):
    cache_only: Annotated[list[PriorityClass], Field(min_length=1)]  # these classes: cached answers or 503


class Shed(_Action):
    shed: Annotated[list[PriorityClass], Field(min_length=1)]  # these classes: 503 with Retry-After
    retry_after_s: Annotated[int, Field(ge=1)] = 30


class DisableCascade(_Action):
    disable_cascade: Literal[True]


class LowerSemanticThreshold(_Action):
    # a negative delta, bounded: a lower threshold serves more near matches, so it may not go far
    semantic_threshold_delta: Annotated[float, Field(ge=-MAX_THRESHOLD_DROP, lt=0)]


Action = RemapTiers | CapOutputTokens | CapInputTokens | CacheOnly | Shed | DisableCascade | LowerSemanticThreshold


class Condition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: Metric
    above: float | None = None
    below: float | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Condition:
        if (self.above is None) == (self.below is None):
            raise ValueError("a condition needs exactly one of `above` or `below`")
        return self

    def holds(self, value: float) -> bool:
        return value > self.above if self.above is not None else value < self.below  # type: ignore[operator]


class Trigger(BaseModel):
    """Conditions (any of them) that must hold continuously for `for_s` seconds."""

    model_config = ConfigDict(extra="forbid")

    any: Annotated[list[Condition], Field(min_length=1)]
    for_s: Annotated[float, Field(ge=0)] = 30.0


class Level(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Annotated[int, Field(ge=0)]
    name: str
    description: str = ""
    actions: list[Action] = Field(default_factory=list)
    enter: Trigger | None = None  # rise to this level when it holds
    exit: Trigger | None = None  # leave it (one level down) when this holds: the hysteresis
    min_dwell_s: Annotated[float, Field(ge=0)] = 60.0


class Ladder(BaseModel):
    model_config = ConfigDict(extra="forbid")

    levels: Annotated[list[Level], Field(min_length=1)]

    @model_validator(mode="after")
    def _ordered(self) -> Ladder:
        numbers = [lv.level for lv in self.levels]
        if numbers != list(range(len(numbers))):
            raise ValueError(f"levels must be numbered 0, 1, 2, … in order; got {numbers}")
        if self.levels[0].actions or self.levels[0].enter:
            raise ValueError("level 0 is normal service: no actions, no enter trigger")
        for lv in self.levels[1:]:
            if lv.enter is not None and lv.exit is None:
                raise ValueError(f"level {lv.level} has an enter trigger but no exit trigger")
        return self

    @property
    def top(self) -> int:
        return len(self.levels) - 1


def load_ladder(path: Path, tiers: Collection[str]) -> Ladder:
    """The ladder file, its remaps checked against the tiers file's `tiers`; ConfigFileError with file and line."""
    return load_yaml(path, Ladder, context={"tiers": set(tiers)})
