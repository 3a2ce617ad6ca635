"""Rollouts as the admin routes, the CLI and the route stage see them: start, promote, pause, rollback, status,
and each request's version; and the guards that roll a rollout back by themselves.

The service keeps the rollouts it read last; a gateway follows the store every few seconds (a change made by the
CLI or another process takes effect then; one made through this process's admin routes, at once). The route
stage asks `choose` for every request to a tier with versions: a dictionary read and, during a canary, one hash.
A candidate that cannot take the request (no replica up) is not a 503: the baseline answers it, and it counts as
an error of the candidate, so the guards see a dead candidate as one that fails; but where what stops it is only
its circuit breakers, open on failures already counted under the tenants who caused them, the request is counted
as passed over (traffic due to the candidate, not an error: guards.py says why).

Each version's outcomes are counted here, per process (`observe`, from settle: O(1)), in counters since the rollout
started and in the guards' bounded windows (gateway/rollout/guards.py); `evaluate`, run about once a second off
the request path, judges each running rollout and rolls back one whose guard has held breached, as `guard`, with
the windows in the audit event. With several gateway processes each judges what it saw; the first to roll back
wins the store's compare-and-set and the others follow it. Each outcome carries its tenant and prompt size: a guard
compares latency per prompt size and lets no one tenant's outcomes decide alone (guards.py says why and how); the
candidate's errors counted when the gateway finds it down are its own, no tenant's.

A version may not take away what the tier offers a request (gateway/pipeline/needs.py: tool calls, vLLM's `top_k`):
`start` refuses a candidate that lacks what the version answering now has (a remote version on a plain `openai`
dialect under a vLLM tier, or `tools: false`). Letting it run would either answer such requests wrongly (OpenAI
refuses `top_k`, a lenient server drops it) or keep them on the baseline, and then the two versions no longer answer
the same mix of requests, which the guards' comparisons assume (guards.py). An operator who means to take it away
names the new version `serving` in the tiers file, which routing reads. A rollout that lacks it anyway (stored
before this check, or under a tiers file edited since) still answers correctly: routing judges a tier by its
`steady` version, and `choose` gives the baseline a request the candidate lacks something for (`lacks`), the same
for every turn that needs it, counted as the baseline's outcome and never as the candidate's error.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from gateway.errors import Conflict, InvalidRequest, NotFound, TiergateError
from gateway.ladder.controller import LadderChangeError, check_reason
from gateway.metrics import GatewayMetrics
from gateway.pipeline.needs import taken_away
from gateway.rollout.assign import sampled, version_for
from gateway.rollout.guards import Guards, Verdict, Watch, tier_guards_error
from gateway.rollout.state import RUNNING, Action, Rollout, RolloutEvent, RolloutStore, Stage
from tiers.catalogue import TierCatalogue, TierSpec

log = logging.getLogger("tiergate.rollout")


class RolloutService:
    def __init__(self, catalogue: TierCatalogue, store: RolloutStore, *,
                 clock: Callable[[], float] = time.time, metrics: GatewayMetrics | None = None) -> None:
        self.catalogue = catalogue
        self.store = store
        self.clock = clock
        self.metrics = metrics  # each version's requests, errors and TTFT during a rollout, for Prometheus
        if (bad := tier_guards_error(catalogue)) is not None:  # a startup error, not a surprise at the first start
            raise ValueError(bad)
        self._rollouts: dict[str, Rollout] = store.load()
        self._merging = threading.Lock()  # held only to merge a read into `_rollouts` (no I/O under it)
        self._counts: dict[tuple[str, str], list[int]] = {}  # (rollout id, version) -> [requests, errors]
        self.watch = Watch()

    def follow(self) -> None:
        """Read the store again (another process or the CLI may have changed a rollout). A change this process
        saved after that read (an admin's rollback while the follower read) stays: see `_merge`."""
        self._merge(self.store.load())

    # ---- the request path ----

    def choose(self, tier: TierSpec, tenant: str, conversation: Callable[[], str],
               down: Callable[[TierSpec], str | None] = lambda spec: None,
               lacks: Callable[[TierSpec], str | None] = lambda spec: None) -> tuple[TierSpec, str | None]:
        """The spec of the version that answers this request, and a note for the route reason (None when the tier
        has no rollout). `conversation` is called only when a canary needs it; `down` says why a version's
        replicas cannot take a request now (None: they can); `lacks` why a version cannot answer this request as
        asked (None: it can; the route stage sends such a request only to a tier whose `steady` version can)."""
        rollout = self._rollouts.get(tier.name)
        if rollout is None or tier.version_name is None:
            return tier, None
        version = version_for(rollout, tenant, conversation() if rollout.stage in RUNNING else "")
        spec = tier.variants.get(version)
        if spec is None:  # the tiers file no longer declares it: the serving version answers
            return tier, f"version {tier.version_name} ({version} is not declared)"
        if rollout.stage in RUNNING and version == rollout.candidate and (why := lacks(spec)) is not None:
            # not the candidate's error: it was never asked. Its baseline answers, or, where the tiers file no longer
            # declares that, the serving version (what `steady` judged the tier by)
            baseline = self._variant(tier.name, rollout.baseline) or tier
            return baseline, f"version {baseline.version_name} (candidate {version}: {why})"
        if rollout.stage in RUNNING and version == rollout.candidate and (why := down(spec)) is not None:
            # its breakers open: the failures that opened them are counted already, under the tenants who caused
            # them; this request is traffic due to the candidate, no error of it or of this tenant (guards.py)
            opened = _breakers_open(why)
            fallback = self._variant(tier.name, rollout.baseline) if opened else self.fall_back(tier, version)
            if fallback is not None:
                if opened:
                    self.watch.window(rollout.id, version).add_passed(self.clock(), tenant)
                return fallback, f"version {rollout.baseline} (candidate {version} is down: {why})"
        return spec, f"version {version} (rollout {rollout.stage}{_share(rollout)})"

    def steady(self, tier: TierSpec) -> TierSpec:
        """The version that answers the tier's requests outside a canary's share: the baseline while a rollout runs
        (or after it rolled back), the candidate once it is `full`, the tier's serving version without a rollout
        (or when the tiers file no longer declares the version). What the tier offers a request (needs.py) is
        what this version has."""
        rollout = self._rollouts.get(tier.name)
        if rollout is None or tier.version_name is None:
            return tier
        return tier.variants.get(rollout.candidate if rollout.stage == "full" else rollout.baseline, tier)

    def serving(self, tier: TierSpec) -> list[TierSpec]:
        """The versions that may answer the tier's requests now: its `steady` one and a running rollout's candidate
        (a canary's share and named tenants; a paused one's, which may resume). The cache keeps their answers and
        retires the others' (gateway/model_versions.py)."""
        steady = self.steady(tier)
        rollout = self._rollouts.get(tier.name)
        if rollout is None or tier.version_name is None or rollout.stage not in RUNNING:
            return [steady]
        candidate = tier.variants.get(rollout.candidate)
        return [steady] if candidate is None or candidate is steady else [steady, candidate]

    def fall_back(self, tier: TierSpec, version: str | None) -> TierSpec | None:
        """The baseline's spec for a request the running rollout's candidate `version` cannot take, counted as an
        error of the candidate; None if `version` is not a running rollout's candidate."""
        rollout = self._rollouts.get(tier.name)
        if rollout is None or rollout.stage not in RUNNING or version != rollout.candidate:
            return None
        baseline = self._variant(tier.name, rollout.baseline)
        if baseline is None:
            return None
        self.observe(tier.name, version, error=True)
        return baseline

    def observe(self, tier: str, version: str, *, error: bool, ttft_s: float | None = None,
                tpot_s: float | None = None, tenant: str | None = None, prompt_tokens: int | None = None) -> None:
        """A request the version answered (or failed with a server error): counted for `status` and the guards.
        `tenant` is whose request it was (None: the gateway's own observation, e.g. a candidate found down), and
        `prompt_tokens` its prompt's size (None: unknown)."""
        rollout = self._rollouts.get(tier)
        if rollout is not None and version in (rollout.candidate, rollout.baseline):
            counts = self._counts.setdefault((rollout.id, version), [0, 0])
            counts[0] += 1
            counts[1] += error
            if rollout.stage in RUNNING:
                self.watch.window(rollout.id, version).add(self.clock(), error=error, ttft_s=ttft_s, tpot_s=tpot_s,
                                                           tenant=tenant, prompt_tokens=prompt_tokens)
            if self.metrics is not None:
                self.metrics.version_finished(tier, version, failed=error, ttft_s=ttft_s)

    def shadow_of(self, tier: TierSpec, request_id: str) -> tuple[Rollout, TierSpec] | None:
        """The candidate to copy this request to, when the tier's rollout is a shadow that samples it and `tier` is
        the version answering everyone (its baseline)."""
        rollout = self._rollouts.get(tier.name)
        if rollout is None or rollout.stage != "shadow" or tier.version_name != rollout.baseline \
                or not sampled(rollout, request_id):
            return None
        spec = self._variant(tier.name, rollout.candidate)
        return None if spec is None else (rollout, spec)

    def observe_shadow(self, rollout: Rollout, *, error: bool, ttft_s: float | None, tpot_s: float | None,
                       divergence: float | None, tenant: str | None = None,
                       prompt_tokens: int | None = None) -> None:
        """A shadowed request's outcome on the candidate (never seen by the tenant), for `status` and the guards;
        `tenant` is whose request was copied."""
        current = self._rollouts.get(rollout.tier)
        if current is None or current.id != rollout.id:
            return
        counts = self._counts.setdefault((rollout.id, rollout.candidate), [0, 0])
        counts[0] += 1
        counts[1] += error
        window = self.watch.window(rollout.id, rollout.candidate)
        now = self.clock()
        window.add(now, error=error, ttft_s=ttft_s, tpot_s=tpot_s, tenant=tenant, prompt_tokens=prompt_tokens)
        if divergence is not None:
            window.add_divergence(now, divergence, tenant)

    # ---- the guards ----

    def evaluate(self) -> list[Verdict]:
        """Judge each running rollout's guards; roll back, as `guard`, those breached for their `breach_for_s`."""
        running = {r.id: r for r in self._rollouts.values() if r.stage in RUNNING}
        self.watch.forget(running)
        verdicts = []
        for r in running.values():
            verdict = self.watch.evaluate(r.id, r.tier, r.candidate, r.baseline, r.guards, self.clock(),
                                          share=None if r.stage == "shadow" else r.share, named=r.tenants)
            verdicts.append(verdict)
            if verdict.roll_back:
                self._guard_rollback(r, verdict)
        return verdicts

    def _guard_rollback(self, r: Rollout, verdict: Verdict) -> None:
        reason = f"guard {'; '.join(verdict.breached)}; breached for {r.guards.breach_for_s:g}s"
        try:
            current = self._latest(r.tier)
            if current is None or current.id != r.id or current.stage not in RUNNING:
                return  # changed elsewhere meanwhile (another process's guard, an admin)
            self._save("rollback", current.changed(stage="rolled_back", who="guard", reason=reason,
                                                   now=self.clock()), verdict.metrics())
        except TiergateError as exc:  # another process won the compare-and-set: its change stands
            log.warning("guard rollback of tier %s not written: %s", r.tier, exc.message)

    # ---- on-call ----

    def start(self, tier: str, version: str, *, share: float, tenants: tuple[str, ...] = (), who: str,
              reason: str, shadow: float | None = None, guards: Guards | None = None) -> Rollout:
        """A canary of `version` on `tier`: `share` of new conversations and every named tenant; or, with `shadow`,
        a shadow: the serving version answers everyone, and that share of requests is also sent to `version`."""
        reason = _reason(reason)
        # the tier and the version are named in the body: one that does not exist is bad input, a 400 (a 404 is
        # for a tier in the path, as promote's)
        spec = self._tier(tier, missing=InvalidRequest)
        if version not in spec.variants:
            raise InvalidRequest(f"tier {tier!r} has no version {version!r}; it has {', '.join(spec.variants)}",
                                 param="version", code="version_not_found")
        _check_share(share)
        _named_once(tenants)
        if shadow is not None:
            _check_share(shadow, "shadow")
            if share or tenants:
                raise InvalidRequest("a shadow answers no one from the candidate: leave share and tenants out, and "
                                     "give them when promoting it to a canary", param="share" if share else "tenants",
                                     code="shadow_answers_no_one")
        current = self._latest(tier)
        if current is not None and current.stage in RUNNING:
            raise Conflict(f"tier {tier!r} has a rollout in progress ({current.candidate}, {current.stage}); "
                           "promote it to full or roll it back first", code="rollout_in_progress")
        baseline = _answering(current, spec)
        if version == baseline:
            raise Conflict(f"version {version!r} already answers tier {tier!r}", param="version",
                           code="version_already_serving")
        if lost := taken_away(spec.variants[baseline], spec.variants[version]):
            raise InvalidRequest(
                f"version {version!r} {' and '.join(n.cannot for n in lost)}, which version {baseline!r} answering "
                f"tier {tier!r} can: requests that need it would never reach the candidate, so the rollout could "
                f"not judge it on them; to take it away from the tier, name {version!r} `serving` in the tiers file",
                param="version", code="version_lacks_capability")
        now = self.clock()
        rollout = Rollout(uuid.uuid4().hex[:16], tier, version, baseline, "canary" if shadow is None else "shadow",
                          share, tuple(tenants), now, who, now, who, reason,
                          (current.revision if current else 0) + 1, _guards(spec, guards), shadow or 0.0)
        return self._save("start", rollout)

    def promote(self, tier: str, *, share: float | None = None, who: str, reason: str) -> Rollout:
        """To `full` (everyone on the candidate), or a larger canary `share` (a paused canary resumes; a shadow
        becomes a canary)."""
        reason = _reason(reason)
        current = self._running(tier, "promote")
        if share is None and current.stage == "paused" and current.shadow:
            # a paused shadow (stored before `pause` refused one) never answered a tenant from the candidate
            raise _paused_shadow(tier)
        if share is None:
            return self._save("promote", current.changed(stage="full", who=who, reason=reason,
                                                         now=self.clock()), self._metrics_now(current))
        _check_share(share)
        if share < current.share:
            raise InvalidRequest(f"share {share} is below the canary's {current.share}: lowering it would move "
                                 "conversations back mid-way; roll back instead", param="share",
                                 code="share_lowered")
        return self._save("promote", current.changed(stage="canary", who=who, reason=reason,
                                                     now=self.clock(), share=share), self._metrics_now(current))

    def pause(self, tier: str, *, who: str, reason: str) -> Rollout:
        """Hold the canary as it is: the same conversations stay on each version, and the share stays. A shadow is
        not paused (a 409): it answers no tenant from the candidate, so there is nothing to hold; a paused one would
        be a 0% canary that a plain promote sends to `full`, untested on any tenant."""
        reason = _reason(reason)
        current = self._running(tier, "pause")
        if current.stage == "paused":
            raise Conflict(f"the rollout on tier {tier!r} is paused already", code="rollout_paused")
        if current.stage == "shadow":
            raise Conflict(f"the rollout on tier {tier!r} is a shadow: it sends no tenant's traffic to the candidate, "
                           "so there is nothing to pause; roll it back to stop its copies, or promote it with a "
                           "share to make it a canary", code="shadow_not_pausable")
        return self._save("pause", current.changed(stage="paused", who=who, reason=reason, now=self.clock()),
                          self._metrics_now(current))

    def rollback(self, tier: str, *, who: str, reason: str) -> Rollout:
        """Everyone back on the baseline (from a shadow, a canary, a pause, or a finished `full`)."""
        reason = _reason(reason)
        current = self._latest(tier)
        self._tier(tier)
        if current is None or current.stage == "rolled_back":
            raise _nothing_to(tier, "roll back", current)
        return self._save("rollback", current.changed(stage="rolled_back", who=who, reason=reason,
                                                      now=self.clock()), self._metrics_now(current))

    # ---- reading ----

    def status(self) -> list[dict[str, Any]]:
        """Each tier's latest rollout, with each version's requests and errors since it started, and the guards'
        latest evaluation of the windows (this process's)."""
        out = []
        for _, r in sorted(self._rollouts.items()):
            versions = {v: dict(zip(("requests", "errors"), self._counts.get((r.id, v), [0, 0]), strict=True))
                        for v in (r.baseline, r.candidate)}
            verdict = self.watch.last.get(r.tier)
            out.append(r.public() | {"versions": versions,
                                     "guard": verdict.public() if verdict and verdict.rollout_id == r.id else None})
        return out

    def history(self, tier: str | None = None, limit: int = 100) -> list[RolloutEvent]:
        return self.store.history(tier, limit)

    # ---- helpers ----

    def _tier(self, tier: str, *, missing: type[TiergateError] = NotFound) -> TierSpec:
        """The tier's spec; a tier that does not exist, or declares no versions, is a `missing` (a 404 by default:
        a tier in the path)."""
        spec = self.catalogue.tiers.get(tier)
        if spec is None:
            raise missing(f"no tier {tier[:128]!r}; tiers: {', '.join(self.catalogue.tiers)}", param="tier",
                          code="tier_not_found")
        if spec.version_name is None:
            raise missing(f"tier {tier!r} declares no `versions` in the tiers file", param="tier",
                          code="tier_has_no_versions")
        return spec

    def _variant(self, tier: str, version: str) -> TierSpec | None:
        """One version's spec (a version's own spec lists no variants: the tier's does)."""
        spec = self.catalogue.tiers.get(tier)
        return None if spec is None else spec.variants.get(version)

    def _latest(self, tier: str) -> Rollout | None:
        """The tier's latest rollout as the store has it now (a change starts from the truth, not a cache)."""
        self._merge(self.store.load())
        return self._rollouts.get(tier)

    def _merge(self, read: dict[str, Rollout]) -> None:
        """Take each tier's rollout in `read` unless this process holds a newer one (a higher revision: each save is
        a compare-and-set on it, so revisions only grow). A read is a snapshot: a change saved here after it was
        taken would otherwise be undone here until the next follow, while the store has it."""
        with self._merging:
            mine = self._rollouts
            self._rollouts = mine | {t: r for t, r in read.items() if t not in mine or r.revision >= mine[t].revision}

    def _running(self, tier: str, what: str) -> Rollout:
        self._tier(tier)
        current = self._latest(tier)
        if current is None or current.stage not in RUNNING:
            raise _nothing_to(tier, what, current)
        return current

    def _metrics_now(self, r: Rollout) -> dict[str, Any]:
        """What an admin's change keeps in its audit event: each version's window as it is now (this process's)."""
        readings = self.watch.read(r.id, (r.baseline, r.candidate), self.clock() - r.guards.window_s)
        return {v: reading.public() for v, reading in readings.items()}

    def _save(self, action: Action, rollout: Rollout, metrics: dict[str, Any] | None = None) -> Rollout:
        if not self.store.save(rollout, RolloutEvent.of(action, rollout, metrics)):
            raise Conflict(f"the rollout on tier {rollout.tier!r} was changed meanwhile; read its status and retry",
                           code="rollout_changed")
        self._merge({rollout.tier: rollout})
        # the reason quoted (%r): one line, whatever an admin or the CLI gave (a newline forged a second line)
        log.warning("rollout of %s on tier %s: %s%s by %s: %r", rollout.candidate, rollout.tier, rollout.stage,
                    _share(rollout), rollout.changed_by, rollout.reason)
        return rollout


def _answering(current: Rollout | None, spec: TierSpec) -> str:
    """The version everyone has now: the serving one, or what the tier's last rollout left."""
    if current is not None and current.stage == "full" and current.candidate in spec.variants:
        return current.candidate
    if current is not None and current.stage == "rolled_back" and current.baseline in spec.variants:
        return current.baseline
    assert spec.version_name is not None
    return spec.version_name


def _guards(spec: TierSpec, given: Guards | None) -> Guards:
    """The start's guards: what it set, else the tier's `rollout_guards`, else the defaults."""
    chosen = {name: getattr(given, name) for name in given.model_fields_set} if given is not None else {}
    return Guards.model_validate(spec.rollout_guards | chosen, strict=False)


def _check_share(share: float, param: str = "share") -> None:
    if not 0.0 <= share <= 1.0:  # the routes' schema says so too; the CLI comes here directly
        raise InvalidRequest(f"{param} is a fraction from 0 to 1, not {share}", param=param, code="invalid_value")


def _named_once(tenants: tuple[str, ...]) -> None:
    """A 400 `duplicate_tenant` naming the place of a tenant named again (`tenants.2`), as a report's group or a
    query parameter sent twice is refused: it was dropped in silence, and the start's audit kept another list than
    the one sent."""
    seen: dict[str, int] = {}
    for i, name in enumerate(tenants):
        if name in seen:
            raise InvalidRequest(f"tenants.{i}: {name!r} is named already (tenants.{seen[name]}); name each tenant "
                                 "once", param=f"tenants.{i}", code="duplicate_tenant")
        seen[name] = i


def _reason(reason: str) -> str:
    """The reason as the audit trail keeps it (blanks around it cut), or a 400 naming `reason`: one line of text
    (code invalid_value: no newline or other control character), not only blanks (reason_required), as a manual
    degrade's (gateway/ladder/controller.py's check_reason; the routes publish its REASON_PATTERN)."""
    try:
        check_reason(reason)
    except LadderChangeError as exc:
        raise InvalidRequest(f"{exc} (it is kept in the audit trail)", param=exc.param, code=exc.code) from exc
    return reason.strip()


def _share(r: Rollout) -> str:
    if r.stage == "shadow":
        return f" {r.shadow:.2%}"
    return f" {r.share:.2%}" if r.stage in RUNNING else ""


def _paused_shadow(tier: str) -> Conflict:
    return Conflict(f"the rollout on tier {tier!r} is a paused shadow: no tenant has been answered by its candidate, "
                    "so it cannot go to everyone at once; promote it with a share to make it a canary, or roll it "
                    "back", code="paused_shadow")


def _breakers_open(why: str) -> bool:
    """Whether `down`'s reason is only circuit breakers open (each replica's public reason, tiers/fleet.py), not a
    replica that is unhealthy or cannot be reached."""
    return all(part.startswith("circuit breaker") for part in why.split("; "))


def _nothing_to(tier: str, what: str, current: Rollout | None) -> NotFound | Conflict:
    if current is None:
        return NotFound(f"tier {tier!r} has no rollout to {what}", param="tier", code="rollout_not_found")
    stage: Stage = current.stage
    return Conflict(f"the rollout on tier {tier!r} is {stage}; nothing to {what}", code="rollout_finished")
