"""A plan's cascade: a cheap non-streamed `auto` answer that fails its check (tiers/cascade.py) is answered
once more on the next dearer tier. Both attempts are billed; the second's row names the first in
`cascade_of`, the first's route reason says what became of it.

The check: empty, truncated by the context, below the plan's fixed mean log-probability, and then, where the
router's artifact has a calibration for the pair (this tier → the tier a retry would use), the calibrated
confidence against the floor `auto` routed with (tiers/routing.py's `Route.floor`): the answer stands when
it is expected to keep the floor, and the route reason says so either way.

The calibrated check reads the engine's signals (token log-probabilities with the calibration's alternatives,
asked of the tier for this attempt only and never shown to a client that did not ask for them). Where the artifact
has a look-ahead (tiers/difficulty.py's `Lookahead`), the answer is judged as soon as it has one token past the
look-ahead's (or at its end, if shorter) with the heads fitted on answers' first tokens; one that falls short is
not read further (its tier stops; it is billed for the tokens it made) and goes to the dearer tier at once, so a
retried request pays for a few cheap tokens, not a whole cheap answer thrown away (bench/router.py measures
both). An answer that passes the look-ahead stands on it; the plain checks (empty, truncated, fixed threshold)
still run on the whole.

Where the artifact has a stop at a divergence risk for the pair (tiers/divergence.py, `CascadeCalibration.stops`), a
non-streamed answer whose route's floor is at most the mean quality the stop was fitted to keep (`quality`; a
higher floor keeps the per-floor thresholds below) is judged by it instead of the look-ahead and the whole-answer
confidence: the meter sums the risk token by token as the answer comes, and at the first token where it passes the
pair's threshold the answer is not read further (billed for its prompt and the tokens made) and goes to the dearer
tier, the route reason saying where ("divergence risk 0.41 > 0.35 at token 17"). An answer that ends without passing
it stands on it ("within"), then the plain checks run on the whole. Streams keep the look-ahead: a stop could come at
any token, and a stream's tokens are the client's as they come (they cannot be taken back), whereas the look-ahead
holds only a fixed few.

The check runs before the first attempt settles, and the second attempt is reserved then too, so the first
row can say whether the cascade happened, and why not when it did not (no dearer tier, the ladder, a
refused reservation). The second attempt continues the client's one request (reserve.py's `follows`): it takes over
the first's concurrency slot and takes no second place in the requests-per-minute window, while both attempts' tokens
and money are billed; a retry refused (for money, say) leaves the first its slot, freed when its answer is handed
over (reserve.py `_keep_slot`). Under an Idempotency-Key the answer stored is the one the client gets: the second
attempt's; if that one fails, or its ledger row is withdrawn (not durable within the ledger's wait: settle.py; the
retry is billed nothing, and a 503 would leave the client billed for the first answer it never got), the first answer
stands and is stored then, by itself (its ledger row is durable
already), before the client reads it, so the SDK's retry replays it (it was not stored: the retry ran, and was billed,
again); if the first was cut short (by the look-ahead or a stop; one that ended within the look-ahead, whatever its
finish, was read whole and stands), the client gets the second's error.

Streams: a stream's tokens are the client's as they come, so it can be judged only before any is sent. Under a
plan's `cascade_streams`, and only with a look-ahead in the artifact, the stream's first events are held until
the look-ahead has judged: a kept stream then sends what was held and goes on live (its head's route reason
carries the verdict), a failed one is cut and the dearer tier's answer streams instead. A stream shorter than the
look-ahead (whatever its finish: "length" at a small max_tokens too) is held whole and judged at its end: if its
retry fails before its first byte, the whole answer held stands and is sent, as a JSON answer's does (the client got
the retry's error, billed for an answer it never saw).
The plain checks of the whole answer cannot retry a stream (it has been sent). Without a look-ahead a stream is not
checked.

The cache: a cascaded `auto` request was looked up among the answers the check accepted (cache_lookup.py's
`accepted_by`), and its first answer is kept there only when the check ran and accepted it (`_accepted`): a stream
only when the look-ahead judged it and the plain checks pass on the whole. The second attempt's answer is not kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cache import Bypass
from gateway.errors import TiergateError
from gateway.pipeline.attempt import Attempt, Prepared
from gateway.pipeline.cache_lookup import CacheLookup, artifact_version, cascade_acceptance, with_artifact
from gateway.pipeline.context import RequestContext
from gateway.pipeline.events import Delta, Event, Head
from gateway.pipeline.idempotency import IdempotencyStage, Keep
from gateway.pipeline.meter import Meter, Outcome, Reading
from gateway.pipeline.route import RouteDecision, RouteStage
from gateway.pipeline.settle import Settler
from quotas.ledger_withdrawals import RowWithdrawn
from tiers.cascade import AnswerSignals, Verdict, check_answer, check_confidence, next_dearer, outcome_values, values_of
from tiers.divergence import DivergenceRisk
from wire.chat_request import ChatCompletionRequest

log = logging.getLogger("tiergate.cascade")


class Pipeline(Protocol):
    """What the cascade uses of the pipeline that calls it (gateway/pipeline/handle.py)."""

    route: RouteStage
    settler: Settler
    idempotency: IdempotencyStage | None

    def answer(self, ctx: RequestContext, prepared: Prepared, *, judge: Any = None,
               headers: dict[str, str] | None = None, reading: Reading | None = None,
               look: Any = None) -> AsyncIterator[Event]: ...

    async def prepare_on(self, ctx: RequestContext, req: ChatCompletionRequest, route: RouteDecision,
                         lookup: CacheLookup, request_id: str, cascade_of: str | None = None,
                         keep: Keep | None = None) -> Prepared: ...

    def head(self, ctx: RequestContext, req: ChatCompletionRequest, attempt: Attempt,
             extra: dict[str, str] | None = None) -> Head: ...


@dataclass(frozen=True)
class Step:
    attempt: Attempt  # the first attempt, as judged
    second: Prepared | None  # the reserved second attempt, when the cascade goes ahead
    label: str = ""  # `small->mid`


@dataclass(frozen=True)
class Check:
    """What the calibrated check of this request's first answer reads, decided before it is asked for."""

    reading: Reading | None  # the signals to ask the tier for (None: no log-probabilities needed)
    strong: str | None  # the dearer tier a retry would use, for the pair's thresholds
    calibration: Any  # tiers/difficulty.py's CascadeCalibration, or None
    artifact: str | None = None  # the router artifact's version when the check was decided (`artifact_version`)


async def cascade(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared) -> AsyncIterator[Event]:
    step: Step | None = None  # the judgement of the first answer, and the reserved retry if any
    try:  # the first attempt is reserved and `answer`, whose finally settles it, has not started
        check = await _check(pipeline, ctx, prepared)
    except Exception:  # a faulty router artifact must not fail the request: it is answered with the plain checks
        log.exception("the cascade's check of request %s could not be prepared", prepared.attempt.request_id)
        check = _plain(ctx)
    except BaseException:  # the client left while the artifact loaded: nothing ran, nothing is billed, all is freed
        await pipeline.settler.settle(ctx, prepared.attempt, Meter(ctx.t0).outcome("cancelled", 499), None,
                                      wait=False)
        raise
    early: str | None = None  # the look-ahead's note when the answer passed it
    looked = cut = False  # the look-ahead has judged; the first answer was not read further
    seen = prepared.attempt  # the attempt the look-ahead judged (another version's, if a candidate fell back)
    stream = prepared.req.stream

    async def look(attempt: Attempt, first: AnswerSignals | DivergenceRisk, stopped: bool, ended: bool = False
                   ) -> bool:
        """The look-ahead, or the stop at a divergence risk (`first` is then the risk so far: passed, or the whole
        answer's): True to stop reading the answer, which happens only once its retry is reserved (an answer that
        cannot be retried is read to its end and stands, its route reason saying why). `stopped`: it ended with
        "stop" (a signal the heads read); `ended`: it ended within the look-ahead, whatever its finish ("length" at
        a small max_tokens, "tool_calls"), so it was read whole, never cut: if its retry fails, it stands."""
        nonlocal step, early, looked, cut, seen
        seen = attempt
        if isinstance(first, DivergenceRisk):
            verdict = Verdict("divergence_risk", first.note()) if first.passed else None
            note: str | None = first.note()
        else:
            verdict, note = check_confidence(values_of(first, stopped=stopped), calibration=check.calibration,
                                             cheap=attempt.route.tier.name, strong=check.strong or "",
                                             floor=attempt.route.route.floor or 0.0, early=True)
        looked = True
        if verdict is None:
            early = note or ""
            return False
        step = await _escalate(pipeline, ctx, prepared, attempt, verdict)
        cut = step.second is not None and not ended
        return cut

    answered: Outcome | None = None  # the first answer, as judged

    async def judge(attempt: Attempt, outcome: Outcome) -> Attempt:
        nonlocal step, answered
        answered = outcome
        if step is None:
            step = (Step(_streamed(ctx, attempt, outcome, early, check), None) if stream
                    else await _judge(pipeline, ctx, prepared, attempt, outcome, check, early))
        return step.attempt

    started = False  # the reserved second attempt was handed to the pipeline, which settles it
    # Each attempt's `answer` is closed here when the cascade is (a client gone at a `yield`), as handle.py closes the
    # cascade: left suspended, its `finally` (the settle, the dispatch slot, the upstream's connection) waited for the
    # garbage collector, held in a cycle through the cancellation's traceback, and the tenant's slot with it.
    try:
        reading = check.reading
        lookahead = reading is not None and (reading.lookahead is not None or reading.stop is not None)
        if stream and not lookahead:  # a stream can be judged only before any of it is sent: by a look-ahead
            # (unjudged, its answer is not kept for `auto`: its lookup was never `accepted`)
            async with contextlib.aclosing(pipeline.answer(ctx, prepared)) as only:
                async for event in only:
                    yield event
            return
        held: list[Event] = []  # the first answer's events until it is judged (all of them, when not streamed)
        async with contextlib.aclosing(pipeline.answer(ctx, prepared, judge=judge, reading=check.reading,
                                                       look=look if lookahead else None)) as first:
            async for event in first:
                if not stream or not looked or (step is not None and step.second is not None):
                    held.append(event)
                    continue
                if held:  # a stream that passed the look-ahead (or cannot be retried): what was held, then live
                    assert isinstance(held[0], Head)
                    attempt = step.attempt if step is not None else seen
                    yield pipeline.head(ctx, prepared.req,
                                        replace(attempt, extra_reason=(early,)) if early else attempt)
                    for kept in held[1:]:
                        yield kept
                    held = []
                yield event
        assert step is not None
        if step.second is None:
            if held:
                assert isinstance(held[0], Head)
                yield pipeline.head(ctx, prepared.req, step.attempt)
                for event in held[1:]:
                    yield event
            return
        labelled = {"x-tiergate-cascade": step.label}
        started = True  # from here the pipeline settles the second attempt, whatever happens
        async with contextlib.aclosing(pipeline.answer(ctx, step.second, headers=labelled)) as retry:
            try:  # a stream's retry goes live from its head (its errors after that are the client's); JSON's is whole
                second = [await anext(retry)] if stream else [event async for event in retry]
            except (TiergateError, RowWithdrawn) as err:  # the retry failed (settled as such) before any of it was
                # sent, or its row was withdrawn (late past the ledger's wait: the retry is billed nothing): the first
                # answer, billed already, stands, unless it was cut short: then the client gets the retry's error
                if cut:
                    raise
                code = err.code if isinstance(err, TiergateError) else "ledger_unavailable"
                head = pipeline.head(ctx, prepared.req, step.attempt,
                                     {"x-tiergate-cascade": f"{step.label} failed ({code})"})
                if answered is not None:
                    await _keep_standing(pipeline, ctx, prepared, head, answered, held)
                yield head
                for event in held[1:]:
                    yield event
                return
            for event in second:
                yield event
            async for event in retry:  # a stream's, live (a JSON answer's was read whole)
                yield event
    finally:  # a second attempt reserved and never started (the client left, the first's row failed) is settled
        if step is not None and step.second is not None and not started:
            await pipeline.settler.settle(ctx, step.second.attempt, Meter(ctx.t0).outcome("cancelled", 499), None,
                                          wait=False)


async def _keep_standing(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared, head: Head, first: Outcome,
                         held: list[Event]) -> None:
    """Under an Idempotency-Key, the first answer that stands (its retry failed) is the key's answer: stored by itself
    (its row is durable: it was settled before the retry ran), before the client reads it, so a retry replays it; a
    store that cannot keep it gives the claim up (a retry runs again). Its write ends even if the client leaves.
    So too where the retry's row was withdrawn: the retry's answer, handed to the store with that row, went with it,
    and the claim came back to the request (`Keep.row_withdrawn`, before the retry's error reached here), never given
    up meanwhile: given up, a retry with the key ran again and was billed again."""
    keep, stage = prepared.keep, pipeline.idempotency
    if keep is None or stage is None or keep.stored:
        return
    logprobs = [entry for event in held if isinstance(event, Delta) for entry in event.logprobs or ()]
    answer = IdempotencyStage.answer(head, first, logprobs if prepared.req.logprobs else None)
    keep.stored = True  # the claim is the answer's from here: given up by `_store_alone` only if it cannot be kept
    kept = pipeline.settler.hand_off(_store_alone(stage, keep, answer, ctx.plan.idempotency_ttl_s))
    with contextlib.suppress(Exception):  # logged by the hand-off; the answer is still the client's
        await asyncio.shield(kept)


async def _store_alone(stage: IdempotencyStage, keep: Keep, answer: dict[str, Any], ttl_s: float) -> None:
    try:
        await stage.store.finish_alone(keep.claim, answer, ttl_s)
    except Exception:
        await stage.store.abandon(keep.claim)
        raise


async def _judge(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared, attempt: Attempt, outcome: Outcome,
                 check: Check, early: str | None) -> Step:
    """The whole answer's checks: the plain ones, then the calibrated confidence unless the look-ahead judged
    it (`early`: its note)."""
    fixed = ctx.plan.routing.cascade_min_mean_logprob
    verdict = check_answer(outcome.text, finish_reason=outcome.finish_reason, cap_by_context=attempt.cap_by_context,
                           mean_logprob=outcome.mean_logprob, min_mean_logprob=fixed)
    if verdict is None:
        verdict, note = (None, early) if early is not None else _confidence(attempt, outcome, check)
        if verdict is None:
            return Step(_accepted(ctx, replace(attempt, extra_reason=(note,)) if note else attempt, check), None)
    return await _escalate(pipeline, ctx, prepared, attempt, verdict)


def _streamed(ctx: RequestContext, attempt: Attempt, outcome: Outcome, early: str | None, check: Check) -> Attempt:
    """A streamed first answer at its end, sent whole (never retried): the look-ahead's note on its route reason
    (`early`, None when it did not judge), and kept in the cache only when the look-ahead judged it and the plain
    checks pass on the whole answer."""
    if early is None:
        return attempt
    noted = replace(attempt, extra_reason=(early,)) if early else attempt
    fixed = ctx.plan.routing.cascade_min_mean_logprob
    if check_answer(outcome.text, finish_reason=outcome.finish_reason, cap_by_context=attempt.cap_by_context,
                    mean_logprob=outcome.mean_logprob, min_mean_logprob=fixed) is not None:
        return noted
    return _accepted(ctx, noted, check)


def _accepted(ctx: RequestContext, attempt: Attempt, check: Check) -> Attempt:
    """The attempt whose answer the check accepted: its lookup marked so, and so kept, where the check that ran is
    the one its scope names (at a floor a low budget relaxed it is not), under the router artifact the check read
    (`with_artifact`: the one loaded at the lookup, unless another has been loaded since)."""
    lookup = attempt.lookup
    if lookup.accepted_by is None or lookup.accepted_by != cascade_acceptance(ctx.plan.routing,
                                                                              attempt.route.route.floor):
        return attempt
    scope = with_artifact(lookup.scope, check.artifact) if lookup.scope is not None else None
    return replace(attempt, lookup=replace(lookup, scope=scope, accepted=True))


async def _escalate(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared, attempt: Attempt,
                    verdict: Verdict) -> Step:
    """The retry of a failed answer on the next dearer tier, reserved; or why there is none."""
    tier, fleet = attempt.route.tier, pipeline.route.fleet
    # never a tier that cannot honour the request (its `unable`: vLLM's top_k on a plain OpenAI server)
    target = next_dearer(fleet.catalogue, tier, ctx.plan.allowed_tiers, fleet.unavailable() | attempt.route.unable,
                         verdict)
    degr = attempt.route.degradation
    unkept = replace(attempt.lookup, scope=None)  # an answer that failed its check is not worth keeping
    if target is None:
        return Step(replace(attempt, lookup=unkept, extra_reason=(f"{verdict.why}, no dearer tier to cascade to",)),
                    None)
    if degr.cascade_disabled:
        return Step(replace(attempt, lookup=unkept, applied=(*attempt.applied, "disable_cascade"),
                            extra_reason=(f"{verdict.why}, not cascaded (degrade level {degr.level})",)), None)
    if degr.moves_off(target.name):  # the level remaps requests off that tier: a cascade may not bring them back
        return Step(replace(attempt, lookup=unkept, extra_reason=(
            f"{verdict.why}, not cascaded to {target.name} (degrade level {degr.level} remaps it)",)), None)
    second_id = f"{attempt.request_id}-cascade"
    route = pipeline.route.on_version(ctx, prepared.req,
                                      attempt.route.moved_to(target, f"cascade from {tier.name} ({verdict.why})"))
    no_cache = CacheLookup(Bypass("bypass: a cascade's second attempt"), None, None, {}, ctx.headers, ())
    try:
        second = await pipeline.prepare_on(ctx, prepared.req, route, no_cache, second_id,
                                           cascade_of=attempt.request_id, keep=prepared.keep)
    except TiergateError as err:  # over budget or limits for a second attempt: the first answer stands
        why = f"{verdict.why}, cascade to {target.name} refused ({err.code})"
        return Step(replace(attempt, lookup=unkept, extra_reason=(why,)), None)
    pipeline.settler.metrics.cascades.labels(tier.name, target.name, verdict.code).inc()
    judged = replace(attempt, lookup=unkept, final=False,  # the second attempt's answer is the client's
                     extra_reason=(f"{verdict.why}: cascaded to {target.name} as {second_id}",))
    return Step(judged, second, f"{tier.name}->{target.name}")


def _confidence(attempt: Attempt, outcome: Outcome, check: Check) -> tuple[Verdict | None, str | None]:
    """The calibrated check of the whole answer (the router's artifact has no look-ahead for the pair)."""
    if check.strong is None or attempt.route.route.floor is None:
        return None, None
    return check_confidence(outcome_values(outcome), calibration=check.calibration, cheap=attempt.route.tier.name,
                            strong=check.strong, floor=attempt.route.route.floor)


async def _check(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared) -> Check:
    """What the first answer's check will read: the calibration's pair for (this tier → the dearer tier a retry
    would use), only for a route `auto` gave a floor (the thresholds are per pair and floor); log-probabilities
    also where the plan's fixed threshold reads them."""
    attempt, fixed = prepared.attempt, _plain(ctx).reading
    floor, source = attempt.route.route.floor, pipeline.route.predictor
    if floor is None or source is None:
        return Check(fixed, None, None, artifact_version(source))
    fleet = pipeline.route.fleet
    target = next_dearer(fleet.catalogue, attempt.route.tier, ctx.plan.allowed_tiers,
                         fleet.unavailable() | attempt.route.unable, Verdict("low_confidence", ""))
    calibration = await source.calibration()
    artifact = artifact_version(source)  # the calibration's own: nothing awaited in between
    if target is None or calibration is None:
        return Check(fixed, None, None, artifact)
    cheap = attempt.route.tier.name
    stop = calibration.stop(cheap, target.name)
    # a stream keeps the look-ahead (the module's docstring); a floor above the quality the stop was fitted to keep
    # takes the per-floor thresholds of the look-ahead or the whole answer's confidence
    if stop is not None and not prepared.req.stream and floor <= stop.quality:
        return Check(Reading(calibration.top_logprobs, stop=stop), target.name, calibration, artifact)
    if calibration.early_pair(cheap, target.name) is not None:
        return Check(Reading(calibration.top_logprobs, calibration.lookahead.tokens), target.name, calibration,
                     artifact)
    if calibration.pair(cheap, target.name) is not None:
        return Check(Reading(calibration.top_logprobs), target.name, calibration, artifact)
    return Check(fixed, None, None, artifact)


def _plain(ctx: RequestContext) -> Check:
    """The plain checks alone: log-probabilities only where the plan's fixed threshold reads them."""
    return Check(Reading() if ctx.plan.routing.cascade_min_mean_logprob is not None else None, None, None)
