"""`degrade_ladder.yaml`: ordered levels, what each does to a request, and when it switches by itself.

A remap mapping a tier to itself is refused with the file's line. One naming a tier the tiers file does not have
is loaded and warned about (`load_ladder`, and the reload's answer: `unknown_tiers`), not refused: the shipped
ladder remaps `full` to `mid`, and a fleet without one of them must still start. Such a remap does no harm: a source
tier that does not exist is never remapped, and a target that does not exist is passed over for the closest cheaper
tier the plan allows (gateway/ladder/apply.py); the warning is what catches a misspelt name."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from gateway.config_files import load_yaml
from wire.fields import NoBoolNumbers

PriorityClass = Literal["interactive", "standard", "batch"]
Metric = Literal["queue_wait_p95_s", "error_rate", "tiers_down", "redis_down", "kv_utilisation"]
log = logging.getLogger("tiergate.ladder")
MAX_THRESHOLD_DROP = 0.05  # the semantic cache's threshold may be lowered at most this much


class _Action(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")


class RemapTiers(_Action):
    remap_tiers: Annotated[dict[str, str], Field(min_length=1)]  # e.g. {full: mid}

    @model_validator(mode="after")
    def _not_to_itself(self) -> RemapTiers:
        if same := sorted(k for k, v in self.remap_tiers.items() if k == v):
            raise ValueError(f"remap_tiers maps {', '.join(map(repr, same))} to itself")
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


# a threshold or a duration is a finite number: a NaN threshold never held and `.inf` seconds never passed, so a
# level with one never entered or never left, silently
Finite = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Condition(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    metric: Metric
    above: Finite | None = None
    below: Finite | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Condition:
        if (self.above is None) == (self.below is None):
            raise ValueError("a condition needs exactly one of `above` or `below`")
        return self

    def holds(self, value: float) -> bool:
        return value > self.above if self.above is not None else value < self.below  # type: ignore[operator]


class Trigger(NoBoolNumbers):
    """Conditions (any of them) that must hold continuously for `for_s` seconds."""

    model_config = ConfigDict(extra="forbid")

    any: Annotated[list[Condition], Field(min_length=1)]
    for_s: Seconds = 30.0


class Level(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    level: Annotated[int, Field(ge=0)]
    name: str
    description: str = ""
    actions: list[Action] = Field(default_factory=list)
    enter: Trigger | None = None  # rise to this level when it holds
    exit: Trigger | None = None  # leave it (one level down) when this holds: the hysteresis
    min_dwell_s: Seconds = 60.0

    @field_validator("actions")
    @classmethod
    def _one_of_each(cls, actions: list[Action]) -> list[Action]:
        # a request reads the first action of each kind (apply.py): a second one was ignored without a word
        kinds = [next(iter(type(a).model_fields)) for a in actions]  # each action's first field names it
        if twice := sorted({k for k in kinds if kinds.count(k) > 1}):
            raise ValueError(f"more than one {', '.join(twice)} action; give each once")
        return actions


class Ladder(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    levels: Annotated[list[Level], Field(min_length=1)]
    _source: Path | None = PrivateAttr(None)  # the file it was read from (`read_ladder`); None: not from a file

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

    @property
    def source(self) -> Path | None:
        """The file it was read from: where a worker re-reads the ladder another worker's reload put in force."""
        return self._source

    @property
    def sha256(self) -> str:
        """Its identity, the hash of what it says (not of the file's bytes: a comment edited is the same ladder, and
        it is the hash of what was parsed, not of a file that may have changed since)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def unknown_tiers(ladder: Ladder, tiers: Collection[str]) -> list[str]:
    """The tier names the ladder's remaps use that `tiers` (the tiers file's) does not have, sorted."""
    named = {name for lv in ladder.levels for action in lv.actions if isinstance(action, RemapTiers)
             for pair in action.remap_tiers.items() for name in pair}
    return sorted(named - set(tiers))


def read_ladder(path: Path) -> Ladder:
    """The ladder file (ConfigFileError with file and line), remembering where it was read (`Ladder.source`)."""
    ladder = load_yaml(path, Ladder)
    ladder._source = path
    return ladder


def load_ladder(path: Path, tiers: Collection[str]) -> Ladder:
    """The ladder file (ConfigFileError with file and line), a warning logged for remaps naming tiers not in `tiers`."""
    ladder = read_ladder(path)
    if unknown := unknown_tiers(ladder, tiers):
        log.warning("%s: remap_tiers names tiers the tiers file does not have: %s (it has %s); a misspelt name?",
                    path, unknown, sorted(tiers))
    return ladder
