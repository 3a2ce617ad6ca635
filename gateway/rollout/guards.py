"""Guards of a rollout: declared thresholds on the candidate's recent outcomes that roll it back by themselves.

Each version's outcomes during a rollout go into bounded rings (`Window`: at most MAX_SAMPLES, read over the
rollout's `window_s`; past the bound the tenant holding the most gives up its oldest, so one tenant's flood cannot
push the others' out), so memory is bounded whatever the traffic, and recording one is an append. About once a
second, off the request path, `Watch.evaluate` reads the candidate's window against the guards (and the baseline's,
for the latency ratios) and says which guard is breached.

Latency guards are ratios to the baseline's p95 over the same window, not absolute seconds: both versions answer the
same mix of prompts under the same load at the same time, so the ratio isolates the version, while an absolute
bound would have to be re-tuned for every tier, prompt mix and hour of the day. Without enough baseline samples (a
canary at 100%, a shadow of a quiet tier) the latency guards do not judge; the error rate and divergence still do.
The ratio is taken within prompt-size bands (`band`: one for prompts under BAND_TOKENS tokens, then one per
doubling) and averaged over the bands weighted by the candidate's samples, so a candidate that happens to get the
long prompts (a long-context conversation, or a client sending its long prefills there) is compared with the
baseline's long prompts, not its short ones; with all prompts in one band it is the plain ratio of the p95s. The
candidate's p95 is the value it is at least with 95% confidence (`confident_rank`, in gateway/quantiles.py): a canary
has few samples, and a stall both versions share would otherwise set its p95 by itself.

One tenant's outcomes do not decide. A client sees each answer's version (`x-tiergate-model-version`) and names its
conversation (`x-tiergate-session`), so it can find conversations on the candidate and send them only its slowest
or failing requests, or its most divergent prompts: that tenant's own outcomes then say whatever it wants, on
either side. So a guard breached over the whole window is *held* by a tenant when, without that tenant's outcomes,
the others' are enough to judge (CONTEST_MIN on the candidate, and on the baseline for a latency ratio) and are not
packed onto the candidate (at most twice the canary's share of their requests, plus 2: honest traffic is split by
conversation hashes, a steering client's is not), and say the guard is not breached. A held breach does not roll
the rollout back; it is reported (`held`, with the tenant) for an operator to judge. The gateway cannot tell a
candidate that is worse only for one tenant's normal traffic from that tenant steering its requests, so neither
rolls a fleet-wide rollout back on its own while other tenants' traffic says otherwise; a candidate worse for
everyone is breached without any one tenant, and rolls back. Where the others have too few outcomes to judge (the
tier's only tenant, a dominant one), the outcomes there are all the evidence, and judge as before. Tenants named
in the rollout (the operator's chosen canary) and outcomes of no tenant (the gateway's own: a candidate it found
down) are never left out.

A candidate whose circuit breakers are all open is passed over for its baseline (gateway/rollout/service.py's
`choose`). Such a request is no outcome of the candidate's: the failures that opened the breaker are in the window
already, under the tenants who caused them, and counting each request passed over as an error as well would let one
tenant that opens a quiet candidate's breaker make the others' traffic into errors no tenant is blamed for. So it
is kept apart (`Window.passed_over`, under the tenant whose request it was) and counts only as traffic the
candidate was due: towards `min_requests`, and towards the others' outcomes enough to judge without a tenant. The
error rate is the candidate's errors over the requests it answered or failed (none: no error seen, where the
requests passed over are enough to judge: all the others' traffic due to it was passed over, none of it failed).
A candidate that fails everyone opens its breaker on everyone's failures (and fails the others' half-open probes),
and the requests passed over after that bring its window to `min_requests`: it still rolls back; one whose failures
are one tenant's, with the others' answers fine, is held by that tenant.

Hysteresis, in the ladder's shape: a guard rolls back only once it has been breached at every evaluation for
`breach_for_s` seconds; one healthy evaluation starts the clock again. Nothing judges before the candidate has
`min_requests` outcomes in the window: three errors in four requests are not a verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import InvalidRequest
from gateway.quantiles import Ranked, p95
from gateway.rollout.rings import Rings, Tenant
from tiers.catalogue import TierCatalogue
from wire.fields import integral
from wire.validation import describe

MAX_SAMPLES = 4096  # per version and rollout: the outcomes a guard reads (bounded rings, not a growing list)
# a latency ratio breaches only when the p95s also differ by more than this: milliseconds of jitter on a fast tier
# are no regression anyone notices, and would otherwise flap a ratio guard
TTFT_SLACK_S, TPOT_SLACK_S = 0.05, 0.005
BAND_TOKENS = 512  # prompts under this many tokens (or of unknown size) are one band; above, one band per doubling
MAX_CONTESTED = 256  # tenants (those with the most outcomes) whose outcomes an evaluation leaves out in turn
CONTEST_MIN = 10  # outcomes the other tenants need (fewer if min_requests is lower) to hold one tenant's breach

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


def band(prompt_tokens: int | None) -> int:
    """The prompt-size band latency is compared within: 0 under BAND_TOKENS tokens (or unknown), then 1, 2, ... for
    each doubling (512-1023, 1024-2047, ...)."""
    if prompt_tokens is None or prompt_tokens < BAND_TOKENS:
        return 0
    return prompt_tokens.bit_length() - BAND_TOKENS.bit_length() + 1


@dataclass(frozen=True)
class Reading:
    """One version's window, as a guard reads it."""

    requests: int
    errors: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    divergence: float | None  # mean over shadowed answers that both versions gave
    compared: int  # shadowed answers compared
    tenants: int = 0  # tenants with outcomes in the window
    passed_over: int = 0  # requests due to it that went to the baseline while its breakers were open

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def public(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate, 4),
                "ttft_p95_s": _round(self.ttft_p95_s), "tpot_p95_s": _round(self.tpot_p95_s),
                "divergence": _round(self.divergence), "compared": self.compared, "tenants": self.tenants,
                "passed_over": self.passed_over}


EMPTY = Reading(0, 0, None, None, None, 0)

Outcome = tuple[float, bool, float | None, float | None, Tenant, int]  # when, server error, TTFT, TPOT, tenant, band
Diverged = tuple[float, float, Tenant]  # when, divergence, tenant
Passed = tuple[float, Tenant]  # when a request due to the candidate was passed over (its breakers open), tenant


class Window:
    """A version's newest outcomes: (when, server error, TTFT, TPOT, tenant, prompt band) and shadow divergences,
    each at most MAX_SAMPLES, shared out by tenant (`Rings`, gateway/rollout/rings.py)."""

    def __init__(self) -> None:
        self._outcomes: Rings[Outcome] = Rings(MAX_SAMPLES)
        self._divergence: Rings[Diverged] = Rings(MAX_SAMPLES)
        self._passed: Rings[Passed] = Rings(MAX_SAMPLES)

    def add(self, now: float, *, error: bool, ttft_s: float | None, tpot_s: float | None, tenant: Tenant = None,
            prompt_tokens: int | None = None) -> None:
        self._outcomes.append(tenant, (now, error, ttft_s, tpot_s, tenant, band(prompt_tokens)))

    def add_divergence(self, now: float, divergence: float, tenant: Tenant = None) -> None:
        self._divergence.append(tenant, (now, divergence, tenant))

    def add_passed(self, now: float, tenant: Tenant) -> None:
        """A request due to this version that went to the baseline because its breakers were open (no outcome)."""
        self._passed.append(tenant, (now, tenant))

    def passed_over(self, since: float) -> list[Passed]:
        return [p for p in self._passed.items() if p[0] >= since]

    def recent(self, since: float) -> tuple[list[Outcome], list[Diverged]]:
        """The outcomes and divergences from `since` on."""
        return ([o for o in self._outcomes.items() if o[0] >= since],
                [d for d in self._divergence.items() if d[0] >= since])

    def read(self, since: float) -> Reading:
        return _reading(*self.recent(since))


def _reading(recent: list[Outcome], diverged: list[Diverged], passed: Sequence[Passed] = ()) -> Reading:
    return Reading(len(recent), sum(o[1] for o in recent), p95([o[2] for o in recent if o[2] is not None]),
                   p95([o[3] for o in recent if o[3] is not None]),
                   sum(d[1] for d in diverged) / len(diverged) if diverged else None, len(diverged),
                   len({o[4] for o in recent if o[4] is not None}), len(passed))


class Side:
    """One version's window arranged for the guards: totals, and each tenant's part of them."""

    def __init__(self, recent: list[Outcome], diverged: list[Diverged], passed: Iterable[Passed] = ()) -> None:
        self.requests, self.errors = len(recent), sum(o[1] for o in recent)
        self.passed_by_tenant: dict[Tenant, int] = {}  # tenant -> requests passed over (breakers open)
        for _, tenant in passed:
            self.passed_by_tenant[tenant] = self.passed_by_tenant.get(tenant, 0) + 1
        self.passed = sum(self.passed_by_tenant.values())
        self.by_tenant: dict[Tenant, list[int]] = {}  # tenant -> [requests, errors]
        latencies: tuple[dict[int, list[tuple[float, Tenant]]], ...] = ({}, {})  # TTFT, TPOT: band -> samples
        for _, error, ttft, tpot, tenant, size in recent:
            counts = self.by_tenant.setdefault(tenant, [0, 0])
            counts[0] += 1
            counts[1] += error
            for samples, value in zip(latencies, (ttft, tpot), strict=True):
                if value is not None:
                    samples.setdefault(size, []).append((value, tenant))
        self.ttft, self.tpot = ({b: Ranked(s) for b, s in by_band.items()} for by_band in latencies)
        self.diverged, self.compared = sum(d[1] for d in diverged), len(diverged)
        self.divergence_by_tenant: dict[Tenant, list[float]] = {}  # tenant -> [sum, count]
        for _, divergence, tenant in diverged:
            mine = self.divergence_by_tenant.setdefault(tenant, [0.0, 0])
            mine[0] += divergence
            mine[1] += 1

    def count(self, without: Tenant) -> tuple[int, int]:
        """Requests and errors but `without`'s."""
        requests, errors = self.by_tenant.get(without, (0, 0)) if without is not None else (0, 0)
        return self.requests - requests, self.errors - errors

    def due(self, without: Tenant) -> int:
        """Requests due to it but `without`'s: those it answered or failed, and those passed over."""
        return self.count(without)[0] + self.passed - (self.passed_by_tenant.get(without, 0) if without else 0)

    def divergence(self, without: Tenant) -> tuple[float | None, int]:
        """The mean divergence and the answers compared but `without`'s."""
        total, n = self.divergence_by_tenant.get(without, (0.0, 0)) if without is not None else (0.0, 0)
        left = self.compared - int(n)
        return ((self.diverged - total) / left if left else None), left


@dataclass(frozen=True)
class Finding:
    """What one guard reads in a window: breached or not, and its numbers."""

    breached: bool
    value: str
    detail: str

    def words(self, name: str, bound: float) -> str:
        return f"{name}: {self.value}{f' > {bound}' if self.breached else ''} ({self.detail})"

    def numbers(self) -> str:
        return f"{self.value} ({self.detail})"


def _latency(bound: float | None, slack: float, candidate: dict[int, Ranked], baseline: dict[int, Ranked],
             without: Tenant, band_min: int) -> Finding | None:
    """The candidate's p95 over the baseline's, band by band, averaged by the candidate's samples in each band."""
    if bound is None:
        return None
    if len(candidate.keys() | baseline.keys()) == 1:
        band_min = 1  # one band: the plain ratio of the p95s, as many samples as the window has
    weight = ratio = cand_s = base_s = 0.0
    bands = 0
    for b, cand in candidate.items():
        base = baseline.get(b)
        n = cand.size(without)
        if base is None or n < 1 or base.size(without) < band_min:
            continue
        c, p = cand.p95(without, confident=True), base.p95(without)
        if c is None or not p:
            continue
        weight, bands = weight + n, bands + 1
        ratio, cand_s, base_s = ratio + n * c / p, cand_s + n * c, base_s + n * p
    if not bands:
        return None
    ratio, cand_s, base_s = ratio / weight, cand_s / weight, base_s / weight
    return Finding(ratio > bound and cand_s - base_s > slack, f"{ratio:.2f}",
                   f"p95 {cand_s:.4f}s over {base_s:.4f}s{f' in {bands} prompt-size bands' if bands > 1 else ''}")


def _findings(guards: Guards, candidate: Side, baseline: Side, without: Tenant, floor: int) -> dict[str, Finding]:
    """What each guard reads in the window but `without`'s outcomes (None: all of them), where there are at least
    `floor` outcomes to judge (the candidate's; and the baseline's for a latency ratio)."""
    requests, errors = candidate.count(without)
    if candidate.due(without) < floor:
        return {}
    out: dict[str, Finding] = {}
    if guards.max_error_rate is not None:  # over what it answered or failed; passed over: traffic, no errors
        rate = errors / requests if requests else 0.0
        passed = candidate.due(without) - requests
        out["max_error_rate"] = Finding(rate > guards.max_error_rate, f"{rate:.3f}", f"{errors} of {requests}" + (
            f"; {passed} more passed over, its breakers open" if passed else ""))
    if requests < floor:
        return out
    if baseline.count(without)[0] >= floor:
        band_min = min(CONTEST_MIN, guards.min_requests)
        for name, bound, slack, cand, base in (
                ("max_ttft_p95_ratio", guards.max_ttft_p95_ratio, TTFT_SLACK_S, candidate.ttft, baseline.ttft),
                ("max_tpot_p95_ratio", guards.max_tpot_p95_ratio, TPOT_SLACK_S, candidate.tpot, baseline.tpot)):
            found = _latency(bound, slack, cand, base, without, band_min)
            if found is not None:
                out[name] = found
    mean, compared = candidate.divergence(without)
    if guards.max_divergence is not None and mean is not None and compared >= floor:
        out["max_divergence"] = Finding(mean > guards.max_divergence, f"{mean:.3f}",
                                        f"over {compared} shadowed answers")
    return out


def _bound(guards: Guards, name: str) -> float:
    value = getattr(guards, name)
    assert value is not None
    return float(value)


def _split(side: Side, named: frozenset[str]) -> int:
    """The side's requests of tenants the rollout splits by conversation (not named ones, nor the gateway's own)."""
    return sum(n for t, (n, _) in side.by_tenant.items() if t is not None and t not in named)


def judge(guards: Guards, candidate: Side, baseline: Side, *, share: float | None = None,
          named: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Each breached guard worded with its numbers (empty: healthy, or too few requests to judge), and each breach
    one tenant holds alone (not acted on: see the module's docstring). `share` is the canary's (None: a shadow),
    `named` the rollout's named tenants."""
    if candidate.due(None) < guards.min_requests:
        return [], []
    whole = {name: f for name, f in _findings(guards, candidate, baseline, None, guards.min_requests).items()
             if f.breached}
    held: dict[str, str] = {}
    chosen = frozenset(named)
    tenants = (candidate.by_tenant.keys() | baseline.by_tenant.keys()) - chosen
    on, off = _split(candidate, chosen), _split(baseline, chosen)
    # the tenants with the most outcomes first, the likeliest to hold a breach alone; past the first MAX_CONTESTED,
    # each has fewer than 1/MAX_CONTESTED of the outcomes, too few to make a p95 by itself
    ranked = sorted((t for t in tenants if t is not None),
                    key=lambda t: (-candidate.by_tenant.get(t, (0, 0))[0] - baseline.by_tenant.get(t, (0, 0))[0], t))
    for tenant in ranked[:MAX_CONTESTED]:
        if whole.keys() <= held.keys():
            break
        if share is not None:  # the others' requests split as the canary splits conversations (a shadow's are)
            others_on = on - candidate.by_tenant.get(tenant, (0, 0))[0]
            others_off = off - baseline.by_tenant.get(tenant, (0, 0))[0]
            if others_on > 2 * share * (others_on + others_off) + 2:
                continue
        rest = _findings(guards, candidate, baseline, tenant, min(CONTEST_MIN, guards.min_requests))
        for name, found in whole.items():
            if name not in held and name in rest and not rest[name].breached:
                held[name] = (f"{found.words(name, _bound(guards, name))} held by tenant {tenant!r} alone: "
                              f"without its outcomes {rest[name].numbers()}")
    return ([f.words(name, _bound(guards, name)) for name, f in whole.items() if name not in held],
            [held[name] for name in whole if name in held])


@dataclass(frozen=True)
class Verdict:
    """One evaluation of a rollout's guards."""

    rollout_id: str
    tier: str
    breached: tuple[str, ...]
    since: float | None  # when the breach began (None: healthy)
    roll_back: bool  # breached for `breach_for_s`: roll it back
    readings: dict[str, Reading]  # version -> its window
    held: tuple[str, ...] = ()  # breaches one tenant's outcomes make alone: reported, not acted on

    def metrics(self) -> dict[str, Any]:
        """What the audit event keeps: each version's window at the time."""
        return {v: r.public() for v, r in self.readings.items()}

    def public(self) -> dict[str, Any]:
        return {"breached": list(self.breached), "breached_since": self.since, "held": list(self.held),
                "versions": self.metrics()}


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

    def _recent(self, rollout_id: str, versions: Iterable[str],
                since: float) -> dict[str, tuple[list[Outcome], list[Diverged], list[Passed]]]:
        windows = {v: self._windows.get((rollout_id, v)) for v in versions}
        return {v: (*w.recent(since), w.passed_over(since)) if w is not None else ([], [], [])
                for v, w in windows.items()}

    def read(self, rollout_id: str, versions: Iterable[str], since: float) -> dict[str, Reading]:
        """Each version's window from `since` on."""
        return {v: _reading(*recent) for v, recent in self._recent(rollout_id, versions, since).items()}

    def evaluate(self, rollout_id: str, tier: str, candidate: str, baseline: str, guards: Guards, now: float, *,
                 share: float | None = None, named: Iterable[str] = ()) -> Verdict:
        """Judge the rollout's guards on its windows; `share` is the canary's (None: a shadow), `named` its named
        tenants."""
        recent = self._recent(rollout_id, (baseline, candidate), now - guards.window_s)
        breached, held = judge(guards, Side(*recent[candidate]), Side(*recent[baseline]), share=share, named=named)
        if breached:
            began = self._since.setdefault(rollout_id, now)
        else:
            self._since.pop(rollout_id, None)
            began = None
        verdict = Verdict(rollout_id, tier, tuple(breached), began,
                          began is not None and now - began >= guards.breach_for_s,
                          {v: _reading(*r) for v, r in recent.items()}, tuple(held))
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
