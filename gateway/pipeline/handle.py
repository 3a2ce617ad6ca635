"""The request path, top to bottom: `Pipeline.handle` is the one function every chat request runs.

    authenticate (the route's key dependency) → gate → parse → degrade → route → prompt → cache → reserve
    → dispatch → call the tier → account → settle

Each stage is a module of this package and returns a frozen result the next one takes. Nothing is charged
before `reserve`; every refusal before it is counted once (`RefusalLog`), and one of the request's own fault is
charged to the tenant's bucket of refused requests (gate.py), with the work it cost. The prompt is counted before
the cache is looked up, so a request that cannot fit (the context, or a whole tokens-per-minute limit or budget:
reserve.py's `refuse_too_large`) is refused before a lookup embeds anything. A prompt long to
count (prompt.py's `Unread.inline`: more than a few kilobytes or turns) is counted holding its floor, the fewest
tokens it can need (reserve.py's `floor`), so a tenant over its request rate, its concurrency, a spent budget or a
tpm too small for even the floor is refused, the 429 of its exact reservation, before its count: counted first,
each such refusal cost up to the body limit's tokenizing, free and without end. The floor's place in the request
rate is the request's (kept by its exact reservation, or a cache hit's; and by a refusal after the count, a prompt
too long), and its tokens are given back before the exact reservation: what is reserved and settled is the exact
count, as for a short prompt, which is counted first (microseconds) and reserved once. From `reserve` on, an
attempt settles exactly once, in the `finally` of `_answer`, whatever ends it: its answer, an upstream error, the
client leaving, or a bug. Streamed and non-streamed requests share every stage; the route only frames the
events differently. A plan's cascade (cascade.py) wraps `auto` answers (streamed ones only with a look-ahead).
The refusals before the reservation that are no stage's own (the ladder's shed and cache-only classes, the early
count) are refuse_early.py's, and an attempt's way onto its tier (a dispatch slot, the stream opened) open_tier.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from decimal import Decimal
from typing import Any

from gateway.errors import InvalidRequest, TiergateError, client_error, not_ready
from gateway.ladder.controller import LadderController
from gateway.pipeline.attempt import Attempt, Prepared
from gateway.pipeline.cache_check import CacheChecks
from gateway.pipeline.cache_lookup import CacheLookup, CacheStage, artifact_version, check_data_version, isolated_user
from gateway.pipeline.cascade import cascade
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import DispatchStage
from gateway.pipeline.events import Delivery, Delta, Done, Event, Head
from gateway.pipeline.gate import Pass, TenantGate, refused_size, scopes_of
from gateway.pipeline.idempotency import HEADER, IdempotencyStage, Keep, keep_when_written, lease_lost
from gateway.pipeline.limit_errors import NeverAdmitted
from gateway.pipeline.meter import Meter, Outcome, Reading
from gateway.pipeline.open_tier import open_tier
from gateway.pipeline.parsed import Derived, ParsedBodies
from gateway.pipeline.prompt import ContextTooLong, Prompt, PromptStage
from gateway.pipeline.refusals import RefusalLog
from gateway.pipeline.refuse_early import degradation, measure_early, refuse_cache_only
from gateway.pipeline.reserve import ReserveStage, ratelimit_headers
from gateway.pipeline.route import RouteDecision, RouteStage
from gateway.pipeline.settle import Settler
from gateway.pipeline.tier_call import TierCaller, Upstream
from gateway.rollout.shadow import Shadow
from gateway.validation import parse_body, refuse_engine_only
from quotas.dispatch import Ticket
from quotas.idempotency import Replay
from quotas.ledger_withdrawals import RowWithdrawn
from tiers.errors import UpstreamRejected
from wire.chat_request import ChatCompletionRequest
from wire.tool_calls import stray_result

log = logging.getLogger("tiergate.pipeline")


class Pipeline:
    def __init__(self, *, gate: TenantGate, ladder: LadderController | None, route: RouteStage, cache: CacheStage,
                 prompt: PromptStage, reserve: ReserveStage, dispatch: DispatchStage, tier: TierCaller,
                 settler: Settler, refusals: RefusalLog, ready: Any = None,
                 idempotency: IdempotencyStage | None = None, shadow: Shadow | None = None,
                 cache_checks: CacheChecks | None = None) -> None:
        self.gate = gate
        self.ladder = ladder
        self.route = route
        self.cache = cache
        self.prompt = prompt
        self.reserve = reserve
        self.dispatch = dispatch
        self.tier = tier
        self.settler = settler
        self.refusals = refusals
        self.ready = ready  # () -> str | None: why the gateway cannot take work now (the ledger cannot write)
        self.idempotency = idempotency
        self.shadow = shadow  # a rollout's shadow: a sample of answered requests copied to its candidate
        self.cache_checks = cache_checks  # a sample of semantic hits asked of the tier too (the cache's error bound)
        self.parsed = ParsedBodies()  # a deterministic body its key sent lately, parsed once (parsed.py)

    def admit(self, ctx: RequestContext) -> Pass:
        """The request's place in its tenant's gate (gate.py), or the gate's 429, counted as a refusal: what a route
        asks before it reads the body, and hands to `handle`."""
        with self.refusals.counted(ctx):
            return self.gate.enter(scopes_of(ctx.tenant, ctx.key_id, ctx.plan.limits, ctx.principal.key.limits))

    async def handle(self, ctx: RequestContext, body: bytes,
                     parse: Callable[[bytes], ChatCompletionRequest] | None = None,
                     entry: Pass | None = None) -> AsyncIterator[Event]:
        """The answer to one request, as events; raises a `TiergateError` before its `Head`. `parse` reads the
        body (a chat request by default; text_completion.parse_completion for POST /v1/completions). `entry`: its
        place in the gate, `admit`'s (entered here when None), left here once this starts."""
        entry = self.admit(ctx) if entry is None else entry
        entry.taken = True
        keep: Keep | None = None

        def release() -> None:
            """The request is over (or stopped for its lost lease): its claim, unless answered, is given up (a retry
            runs again) and its place in the tenant's gate left; once (freed then, or where the route holds it, once
            its answer's body is handed over: gateway/middleware.py `hold_until_sent`)."""
            if keep is not None and keep.settle() and not keep.stored and self.idempotency is not None:
                self.settler.hand_off(self.idempotency.store.abandon(keep.claim))
            entry.leave()

        def charge(err: TiergateError) -> None:
            """A refusal of the request's own fault (a body that does not parse, a model not allowed, a prompt too
            long...): it cost the event loop its parse, and maybe a count, and charges nothing else, so the gate
            charges it to the tenant's bucket of refused requests (gate.py): a flood of them is refused there."""
            tokenized = err.tokenized_chars if isinstance(err, ContextTooLong | NeverAdmitted) else 0
            self.gate.body_refused(ctx.tenant, refused_size(body, ctx.headers, tokenized))

        try:
            with self.refusals.counted(ctx, charge):
                # the ledger cannot write: no new work starts (nor a claim), but a stored answer is replayed, as it
                # writes no row; refused before, a client retrying a lost answer was told 503 for what it had paid
                why = self.ready() if self.ready is not None else None
                if why is not None and (self.idempotency is None or HEADER not in ctx.headers):
                    raise not_ready()
                check_data_version(ctx.headers)
                req, derived = self.parsed.parse_kept(ctx.key_id, parse or parse_request, body)
                if self.idempotency is None:
                    begun = None
                elif why is None:
                    begun = await self.idempotency.begin(ctx, req)
                elif (begun := await self.idempotency.stored(ctx, req)) is None:
                    raise not_ready()
                if isinstance(begun, Replay):
                    limits = await self._count_replay(ctx)
            if isinstance(begun, Replay):  # answered before: the same answer, charged nothing, written nowhere
                for event in IdempotencyStage.replay(req, begun.answer, limits):
                    yield event
                return
            keep = Keep(begun, self.idempotency.renewing(begun)) if begun is not None and self.idempotency else None
            with self.refusals.counted(ctx, charge):
                prepared = await self._prepare(ctx, req, keep, derived)
            events = cascade(self, ctx, prepared) if _cascades(ctx, prepared) else self.answer(ctx, prepared)

            async def stop() -> None:
                """Its lease lost while it waits at the `yield` (a client not reading): its work ends now, settled as
                a client's that left (`Keep.suspend`), and its slots and claim are freed; its client is told later."""
                await events.aclose()
                release()
            try:
                async for event in events:
                    if keep is not None:  # its task is the consumer's while it waits at the `yield` (`Keep`)
                        keep.suspend(stop)
                    yield event
                    if keep is not None:  # its client told here if its lease was lost meanwhile
                        keep.resume()
            except InvalidRequest as exc:
                # the tier refused the request as the tenant's fault (our engine's validation: a prompt too long):
                # it cost what a refused parse costs and more, charged nothing, and counts as one
                if isinstance(exc.__cause__, UpstreamRejected):
                    charge(exc)
                raise
            finally:  # closed here when this is (a client gone at a `yield`), not when the collector frees it
                if keep is not None:  # unless a lost lease's stop is closing them
                    await keep.halted()
                await events.aclose()
        except asyncio.CancelledError:
            if keep is not None and keep.stopped():  # its lease lost: settled as cancelled, and its client told so
                raise lease_lost() from None
            raise
        finally:
            release()

    async def _count_replay(self, ctx: RequestContext) -> dict[str, str]:
        """A replay is a request like any other to the tenant's request rate: it takes its place in the window (or is
        refused, 429, as the exact check refuses), though it costs no tokens or money and writes no row. Free
        replays of a stored answer of megabytes were a flood no limit saw. Its concurrency slot in the store is kept
        until the replayed answer is handed over, as any answer's is (reserve.py `_keep_slot`): settled at once, it
        freed the slot before a byte was sent, and other replicas admitted more. Returned: the `x-ratelimit-*`
        headers of the place it took (its own remaining counts, as a fresh answer's and an embeddings replay's),
        sent with the replayed answer, JSON or stream (`IdempotencyStage.replay`): it used a place and said none."""
        reservation = await self.reserve.reserve(ctx, ctx.request_id, tokens=0, price=Decimal(0))
        self.settler.hand_off(self.reserve.quotas.settle(reservation, tokens=0, price=Decimal(0)))
        return ratelimit_headers(ctx.plan, reservation.decision, ctx.principal.key.limits)

    async def _prepare(self, ctx: RequestContext, req: ChatCompletionRequest, keep: Keep | None,
                       derived: Derived | None = None) -> Prepared:
        """Every check, cheapest first, then the reservation: nothing is charged if any check refuses. `derived`:
        what was derived from a kept body once for its repeats (parsed.py), which the cache's lookup reads."""
        degr = degradation(self.ladder, ctx)
        route = await self.route.choose(ctx, req, degr)
        # counted, and refused if it cannot fit, before the cache is looked up: a lookup may embed the last turn on
        # the embedding queue every tenant shares, which a request that can never run must not hold up
        prompt, held = await measure_early(self.prompt, self.reserve, ctx, req, route)
        lookup = await self.cache.lookup(ctx, req, route.tier, degr, artifact_version(self.route.predictor),
                                         counted_prompt=prompt.num_tokens if prompt is not None else None,
                                         derived=derived)
        if (hit := lookup.hit) is not None:  # a cached answer needs no tier, however busy
            usage = hit.request_usage  # this request's own prompt tokens, not the stored answer's request's
            tokens = usage["prompt_tokens"] + usage["completion_tokens"]
            price = ctx.plan.cache.hit_price_per_1k * tokens / 1000
            reservation = await self.reserve.reserve(ctx, ctx.request_id, tokens=0, price=price, follows=held)
            return Prepared(req, Attempt(ctx.request_id, route, reservation, lookup,
                                         route.applied + lookup.applied, hit_price=price), None, keep)
        refuse_cache_only(ctx, degr, route, lookup)
        if (overloaded := route.overload_refusal()) is not None:
            raise overloaded
        return await self.prepare_on(ctx, req, route, lookup, ctx.request_id, keep=keep, prompt=prompt, held=held)

    async def prepare_on(self, ctx: RequestContext, req: ChatCompletionRequest, route: RouteDecision,
                         lookup: CacheLookup, request_id: str, cascade_of: str | None = None,
                         keep: Keep | None = None, prompt: Prompt | None = None, held: str | None = None
                         ) -> Prepared:
        """Count the prompt for the route's tier (unless `prompt` has it) and reserve (a cascade's second attempt
        enters here too). `held`: the floor the count held (refuse_early.py's `measure_early`), whose rpm place is
        the request's."""
        prompt = prompt or await self.prompt.measure(req, route.tier, route.degradation, owner=ctx.tenant,
                                                     user=isolated_user(ctx, req))
        tier = route.tier
        reservation = await self.reserve.reserve(ctx, request_id, tokens=prompt.num_tokens + prompt.output_cap,
                                                 price=tier.price(prompt.num_tokens, prompt.output_cap),
                                                 follows=cascade_of or held)  # a retry keeps its request's place
        if len(prompt.messages) != len(req.messages):
            req = req.model_copy(update={"messages": list(prompt.messages)})
        attempt = Attempt(request_id, route, reservation, lookup, route.applied + lookup.applied + prompt.applied,
                          cascade_of=cascade_of, cap_by_context=prompt.cap_by_context)
        return Prepared(req, attempt, prompt, keep)

    async def answer(self, ctx: RequestContext, prepared: Prepared, *, judge: Any = None,
                      headers: dict[str, str] | None = None, reading: Reading | None = None,
                      look: Any = None) -> AsyncIterator[Event]:
        """Dispatch → call → account → settle for one attempt. `judge` (the cascade's) sees an ok outcome
        before it is settled and may add to its route reason and actions. `reading`: the engine's signals the
        judge reads (asked of the tier, gathered by the meter). `look(attempt, first_signals, stopped, ended)` (the
        cascade's look-ahead, or its stop at a divergence risk) is awaited once, as soon as the answer has a token
        beyond `reading.lookahead` or its risk passes `reading.stop`'s threshold (`Meter.past_lookahead`), or at its
        end if neither came (told so: `ended`, whatever its finish); when it returns True the answer is not read
        further (and is billed for what came)."""
        attempt, req, keep = prepared.attempt, prepared.req, prepared.keep
        meter = Meter(ctx.t0, keep_logprobs=req.logprobs, reading=reading,
                      counted_input=prepared.prompt.num_tokens if prepared.prompt is not None else 0,
                      output_cap=prepared.prompt.output_cap if prepared.prompt is not None else None)
        ticket: Ticket | None = None
        upstream: Upstream | None = None
        outcome: Outcome | None = None
        wait, with_row, stored = True, (), None
        delivery: Delivery | None = None  # a JSON answer's, told at its `Done` before it settles
        try:
            if attempt.lookup.hit is not None:
                meter.add_cached(attempt.lookup.hit.response, attempt.lookup.hit.request_usage)
                yield self.head(ctx, req, attempt, headers)
                yield Delta(attempt.lookup.hit.response, None)
            else:
                ticket, upstream, attempt = await open_tier(self.dispatch, self.tier, self.route, ctx, prepared,
                                                            meter, reading)
                meter.keep_text = self._reads_text(attempt, keep, judge)
                yield self.head(ctx, req, attempt, headers)  # the version that answers, if a candidate fell back
                async for chunk in upstream:
                    content, logprobs, _, calls = meter.add(chunk)
                    if meter.overran:  # past the max_tokens the tier was sent: the answer ends at its cap
                        meter.stop_reading("length")
                        break
                    if content or calls or (logprobs and req.logprobs):  # logprobs not asked for stay ours
                        yield Delta(content, logprobs if req.logprobs else None, calls or None)
                    if look is not None and meter.past_lookahead:
                        judged_early, look = await look(attempt, meter.first, False), None
                        if judged_early:
                            meter.stop_reading()
                            break
                if look is not None and meter.first is not None:  # it ended within the look-ahead
                    await look(attempt, meter.first, meter.finish_reason == "stop", True)
            outcome = meter.outcome("ok", 200)
            if judge is not None:
                attempt = await judge(attempt, outcome)
            if keep is not None and attempt.final and self.idempotency is not None:
                answered = IdempotencyStage.answer(self.head(ctx, req, attempt, headers), outcome,
                                                   meter.logprobs if req.logprobs else None)
                with_row = self.idempotency.store.finish_with_row(keep.claim, answered, ctx.plan.idempotency_ttl_s)
                stored = answered  # only now: an answer that failed here is not kept (its claim is given up)
            if not req.stream and judge is None:  # a JSON answer its route builds now, before it settles (a judged
                # one is read whole by the cascade first: its `Done` comes after, as a stream's)
                delivery = Delivery()
                yield Done(outcome.finish_reason, outcome.input_tokens, outcome.output_tokens, delivery)
                if delivery.failed is not None:  # its body failed: settled as that error, its answer never kept
                    with_row, stored = (), None
                    raise delivery.failed
        except (asyncio.CancelledError, GeneratorExit):
            outcome, wait = meter.outcome("cancelled", 499), False  # a leaving client's task must not wait
            raise
        except Exception as exc:
            err = client_error(exc)
            # a stream's client has the text so far; a JSON answer's client gets only the error
            outcome = meter.outcome("error", err.status_code, err.code, output_delivered=req.stream)
            if delivery is not None and exc is delivery.failed:  # the route's fault, after a whole answer: not billed
                outcome = replace(outcome, input_tokens=0)
            if err is exc:
                raise
            raise err from exc
        finally:
            kept: asyncio.Task[None] | None = None
            row: asyncio.Future[None] | None = None

            def keep_with_row(written: asyncio.Future[None]) -> None:
                # answered: the claim is the answer's row's from its queueing on, never given up while the row may
                # still commit (a stream's row late past the wait below still bills: a retry must replay its answer,
                # not run and be billed again); kept once the row commits, given up if it is refused for good;
                # withdrawn (a JSON answer's, late: settle.py), the request's again (`Keep.row_withdrawn`)
                nonlocal kept, row
                if stored is not None and keep is not None and self.idempotency is not None:
                    keep.kept_with(written)
                    row = written
                    kept = self.settler.hand_off(keep_when_written(
                        self.idempotency.store, written, keep, stored, ctx.plan.idempotency_ttl_s))

            try:
                if upstream is not None and outcome is not None and (outcome.status != "ok" or meter.cut):
                    await _close_quietly(upstream)
            finally:  # a task cancelled again while the stream closes still settles
                try:
                    await self.settler.settle(ctx, attempt, outcome or meter.outcome("cancelled", 499), ticket,
                                              wait=wait, with_row=with_row, on_queued=keep_with_row,
                                              withdraw=not req.stream)  # a JSON answer's client gets only the error
                except RowWithdrawn:  # its answer was not kept: the claim is this request's again, before any await
                    if keep is not None and row is not None:  # (a cascade's first answer that stands takes it)
                        keep.row_withdrawn(row)
                    raise
        try:  # copies of a settled answer, off its path: one that fails is logged, never the client's error
            if self.shadow is not None and attempt.final and prepared.prompt is not None \
                    and not attempt.is_cache_hit and meter.keep_text:  # (not kept: the rollout was not sampling it
                # when the call started)
                self.shadow.send(attempt.route.tier, attempt.request_id, req, prepared.prompt.output_cap,
                                 outcome.text, tenant=ctx.tenant, end_user=isolated_user(ctx, req))
            if self.cache_checks is not None and (hit := attempt.lookup.hit) is not None:
                self.cache_checks.send(ctx.tenant, attempt.route.tier, req, hit, attempt.lookup.policy,
                                       end_user=isolated_user(ctx, req))
        except Exception:
            log.exception("copying the answer of request %s off its path failed", attempt.request_id)
        if kept is not None:
            # answered, written and settled: the answer is kept (its store's write ends even if the client leaves),
            # durable with its row (or in Redis) before the client reads the end. A store that fails here (Redis
            # owes the write, and keeps the key claimed) does not fail an answered request: the hand-off logs it.
            with contextlib.suppress(Exception):
                await asyncio.shield(kept)
        if delivery is None:  # (a JSON answer's came before its settle)
            yield Done(outcome.finish_reason, outcome.input_tokens, outcome.output_tokens)

    def _reads_text(self, attempt: Attempt, keep: Keep | None, judge: Any) -> bool:
        """Whether anything reads the answer's whole text (`Outcome.text`) once it ends: the cascade's check, an
        Idempotency-Key's stored answer, the cache's store, a rollout's shadow. Otherwise the meter keeps only its
        counts (the bill's): a JSON answer's body is the route's own, built from the deltas."""
        return (judge is not None or (keep is not None and self.idempotency is not None)
                or self.cache.may_save(attempt.lookup, attempt.applied)
                or (self.shadow is not None and attempt.final
                    and self.shadow.samples(attempt.route.tier, attempt.request_id)))

    def head(self, ctx: RequestContext, req: ChatCompletionRequest, attempt: Attempt,
             extra: dict[str, str] | None = None) -> Head:
        reason = "; ".join((attempt.route.reason, *attempt.extra_reason))
        headers = {"x-tiergate-tier": attempt.route.tier.name, "x-tiergate-route-reason": reason,
                   **ratelimit_headers(ctx.plan, attempt.reservation.decision, ctx.principal.key.limits),
                   **attempt.lookup.response_headers()}
        if attempt.applied:
            headers["x-tiergate-degrade-actions"] = ",".join(attempt.applied)
        if attempt.route.tier.version_name is not None:  # a tier with versions: the one that answered
            headers["x-tiergate-model-version"] = attempt.route.tier.version_name
        return Head(f"chatcmpl-{ctx.request_id}", int(ctx.arrived), attempt.route.tier.name, headers | (extra or {}),
                    stream=req.stream, include_usage=req.include_usage)


def _cascades(ctx: RequestContext, prepared: Prepared) -> bool:
    """A plan's cascade retries cheap non-streamed `auto` answers, and streamed ones where the plan holds a
    stream for the look-ahead (`cascade_streams`: cascade.py streams it unchecked when there is none)."""
    routing = ctx.plan.routing
    return (routing.cascade and prepared.attempt.route.route.auto and prepared.attempt.lookup.hit is None
            and (not prepared.req.stream or routing.cascade_streams))


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The body as a chat request (400 naming the field otherwise; vLLM's fields the gateway does not honour too,
    and a tool result that answers no call of the assistant message before it, as OpenAI refuses it: our engines
    refused it only once the gateway had routed and reserved it, a remote tier's model read it as some other call's)."""
    req = parse_body(body, ChatCompletionRequest)
    refuse_engine_only(req)
    if (i := stray_result(req)) is not None:  # `invalid_value`, as the gateway's other refused values: it had no code,
        # and the refusal counters named it by its class ("InvalidRequest")
        raise InvalidRequest(f"messages.{i}.tool_call_id: answers no call of the assistant message before its results "
                             "(an id that message did not make, or one answered already); send each result once, "
                             "after the assistant message that made its call", param=f"messages.{i}.tool_call_id",
                             code="invalid_value")
    return req


async def _close_quietly(upstream: Upstream) -> None:
    """Close the tier's stream (which tells the engine to stop); never raises into a settlement."""
    with contextlib.suppress(Exception):  # the connection is being dropped anyway
        await upstream.aclose()
