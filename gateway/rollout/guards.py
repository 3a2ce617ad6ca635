"""Guards of a rollout: declared thresholds on the candidate's recent outcomes that roll it back by themselves.

Each version's outcomes during a rollout go into a fixed-size ring (`Window`: the newest MAX_SAMPLES, read over the
rollout's `window_s`), so memory is bounded whatever the traffic, and recording one is an append. About once a
second, off the request path, `Watch.evaluate` reads the candidate's window against the guards (and the baseline's,
for the latency ratios) and says which guard is breached.

Latency guards are ratios to the baseline's p95 over the same window, not absolute seconds: both versions answer the
same mix of prompts under the same load at the same time, so the ratio isolates the version, while an absolute
bound would have to be re-tuned for every tier, prompt mix and hour of the day. Without enough baseline samples (a
canary at 100%, a shadow of a quiet tier) the latency guards do not judge; the error rate and divergence still do.

Hysteresis, in the ladder's shape: a guard rolls back only once it has been breached at every evaluation for
`breach_for_s` seconds; one healthy evaluation starts the clock again. Nothing judges before the candidate has
`min_requests` outcomes in the window: three errors in four requests are not a verdict.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import InvalidRequest
from tiers.catalogue import TierCatalogue
from wire.fields import integral
from wire.validation import describe

MAX_SAMPLES = 4096  # per version and rollout: the newest outcomes a guard reads (a ring, not a growing list)
# a latency ratio breaches only when the p95s also differ by more than this: milliseconds of jitter on a fast tier
# are no regression anyone notices, and would otherwise flap a ratio guard
TTFT_SLACK_S, TPOT_SLACK_S = 0.05, 0.005

Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=1, le=100, allow_inf_nan=False)]


class Guards(BaseModel):
    """A rollout's declared thresholds (each `None`: that guard is off)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_error_rate: Fraction | None = 0.05  # the candidate's server errors (5xx) over its requests in the window
    max_ttft_p95_ratio: Ratio | None = 1.5  # the candidate's p95 time to first token over the baseline's
    max_tpot_p95_ratio: Ratio | None = 1.5  # the same for time per output token
    max_divergence: Fraction | None = None  # mean output divergence of shadowed answers (gateway/rollout/shadow.py)
    min_requests: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 50  # the candidate's, in the window, before judging
    window_s: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] = 300.0
    breach_for_s: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 30.0  # the hysteresis

    @field_validator("min_requests", mode="before")
    @classmethod
    def _integral(cls, value: object) -> object:
        return integral(value)  # JSON's 50.0 is the integer 50


def guards_from(values: dict[str, Any]) -> Guards:
    """Guards from the CLI's or a caller's values; a bad one is a 400 naming `guards.<field>`."""
    try:
        return Guards.model_validate(values)
    except ValidationError as exc:
        err = describe(exc)
        raise InvalidRequest(f"guards.{err.message}", param=f"guards.{err.param}", code=err.code) from None


def tier_guards_error(catalogue: TierCatalogue) -> str | None:
    """What is wrong with the tiers' `rollout_guards` (their rollouts' default guards), if anything."""
    for spec in catalogue.tiers.values():
        try:
            Guards.model_validate(spec.rollout_guards, strict=False)
        except ValidationError as exc:
            return f"tiers.{spec.name}.rollout_guards: {describe(exc).message}"
    return None


def p95(values: list[float]) -> float | None:
    """The 95th percentile by nearest rank (the smallest value with 95% of the values at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


@dataclass(frozen=True)
class Reading:
    """One version's window, as a guard reads it."""

    requests: int
    errors: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    divergence: float | None  # mean over shadowed answers that both versions gave
    compared: int  # shadowed answers compared

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def public(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate, 4),
                "ttft_p95_s": _round(self.ttft_p95_s), "tpot_p95_s": _round(self.tpot_p95_s),
                "divergence": _round(self.divergence), "compared": self.compared}


EMPTY = Reading(0, 0, None, None, None, 0)


class Window:
    """A version's newest outcomes: (when, server error, TTFT, TPOT) and shadow divergences, each ring bounded."""

    def __init__(self) -> None:
        self._outcomes: deque[tuple[float, bool, float | None, float | None]] = deque(maxlen=MAX_SAMPLES)
        self._divergence: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, now: float, *, error: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        self._outcomes.append((now, error, ttft_s, tpot_s))

    def add_divergence(self, now: float, divergence: float) -> None:
        self._divergence.append((now, divergence))

    def read(self, since: float) -> Reading:
        recent = [o for o in list(self._outcomes) if o[0] >= since]  # list(): one C-level copy, safe off the loop
        diverged = [d for t, d in list(self._divergence) if t >= since]
        return Reading(len(recent), sum(o[1] for o in recent), p95([o[2] for o in recent if o[2] is not None]),
                       p95([o[3] for o in recent if o[3] is not None]),
                       sum(diverged) / len(diverged) if diverged else None, len(diverged))


def breaches(guards: Guards, candidate: Reading, baseline: Reading) -> list[str]:
    """Each breached guard, worded with its numbers (empty: healthy, or too few requests to judge)."""
    if candidate.requests < guards.min_requests:
        return []
    out = []
    if guards.max_error_rate is not None and candidate.error_rate > guards.max_error_rate:
        out.append(f"max_error_rate: {candidate.error_rate:.3f} > {guards.max_error_rate} "
                   f"({candidate.errors} of {candidate.requests})")
    for name, cand, base, bound, slack in (
            ("max_ttft_p95_ratio", candidate.ttft_p95_s, baseline.ttft_p95_s, guards.max_ttft_p95_ratio, TTFT_SLACK_S),
            ("max_tpot_p95_ratio", candidate.tpot_p95_s, baseline.tpot_p95_s, guards.max_tpot_p95_ratio, TPOT_SLACK_S)):
        if bound is None or cand is None or not base or baseline.requests < guards.min_requests:
            continue
        if cand / base > bound and cand - base > slack:
            out.append(f"{name}: {cand / base:.2f} > {bound} (p95 {cand:.4f}s over {base:.4f}s)")
    if guards.max_divergence is not None and candidate.divergence is not None \
            and candidate.compared >= guards.min_requests and candidate.divergence > guards.max_divergence:
        out.append(f"max_divergence: {candidate.divergence:.3f} > {guards.max_divergence} "
                   f"(over {candidate.compared} shadowed answers)")
    return out


@dataclass(frozen=True)
class Verdict:
    """One evaluation of a rollout's guards."""

    rollout_id: str
    tier: str
    breached: tuple[str, ...]
    since: float | None  # when the breach began (None: healthy)
    roll_back: bool  # breached for `breach_for_s`: roll it back
    readings: dict[str, Reading]  # version -> its window

    def metrics(self) -> dict[str, Any]:
        """What the audit event keeps: each version's window at the time."""
        return {v: r.public() for v, r in self.readings.items()}

    def public(self) -> dict[str, Any]:
        return {"breached": list(self.breached), "breached_since": self.since, "versions": self.metrics()}


class Watch:
    """Each running rollout's windows and how long its guards have been breached. Outcomes are added on the event
    loop and evaluations run in a worker thread: each touches the shared dictionaries in single atomic steps."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], Window] = {}  # (rollout id, version) -> its window
        self._since: dict[str, float] = {}  # rollout id -> when its current breach began
        self.last: dict[str, Verdict] = {}  # tier -> its latest evaluation

    def window(self, rollout_id: str, version: str) -> Window:
        found = self._windows.get((rollout_id, version))
        if found is None:
            found = self._windows[(rollout_id, version)] = Window()
        return found

    def read(self, rollout_id: str, versions: Iterable[str], since: float) -> dict[str, Reading]:
        """Each version's window from `since` on."""
        windows = {v: self._windows.get((rollout_id, v)) for v in versions}
        return {v: w.read(since) if w is not None else EMPTY for v, w in windows.items()}

    def evaluate(self, rollout_id: str, tier: str, candidate: str, baseline: str, guards: Guards,
                 now: float) -> Verdict:
        readings = self.read(rollout_id, (baseline, candidate), now - guards.window_s)
        breached = tuple(breaches(guards, readings[candidate], readings[baseline]))
        if breached:
            began = self._since.setdefault(rollout_id, now)
        else:
            self._since.pop(rollout_id, None)
            began = None
        verdict = Verdict(rollout_id, tier, breached, began,
                          began is not None and now - began >= guards.breach_for_s, readings)
        self.last[tier] = verdict
        return verdict

    def forget(self, running: Iterable[str]) -> None:
        """Drop the windows of rollouts no longer running (ids not in `running`)."""
        keep = set(running)
        for key in [k for k in list(self._windows) if k[0] not in keep]:  # list(): observe may add one meanwhile
            self._windows.pop(key, None)
        for rid in [r for r in list(self._since) if r not in keep]:
            self._since.pop(rid, None)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
