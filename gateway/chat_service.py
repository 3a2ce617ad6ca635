"""The request path after validation: route to a tier, call it, stream back, settle in the ledger.

Every attempt that got past admission ends in exactly one ledger row (ok, error or cancelled), written
durably before the client sees the end of its response. A request has one attempt, or two when its plan
cascades: a cheap non-streaming answer that fails its check (tiers/cascade.py) is retried once on the next
dearer tier, and both attempts are billed, the second row naming the first in `cascade_of`.

Replica choice (tiers/replica_choice.py) keeps a conversation on the replica that served its earlier
turns; each attempt's outcome feeds that replica's circuit breaker and latency average.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from engine.protocol import ChatCompletionRequest
from gateway.admission import AdmissionService, Admitted
from gateway.cache_service import CacheService
from gateway.errors import TiergateError, Unavailable, map_tier_error
from gateway.ladder.apply import Degradation
from gateway.ladder.signals import Signals
from gateway.metrics import GatewayMetrics
from gateway.tenants.store import Principal
from quotas.dispatch import QueueFull, Ticket, TierQueue
from quotas.ledger import Ledger, LedgerRow, Refusal
from quotas.plans import PRIORITY_ORDER
from tiers.cascade import check_answer, next_dearer, sum_logprobs
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.errors import NoTierAvailable, TierError, UpstreamRejected, UpstreamUnreachable
from tiers.fleet import Fleet
from tiers.replica import Replica
from tiers.replica_choice import SESSION_HEADER, affinity_key
from tiers.routing import Route

MAX_ATTEMPTS = 2  # a replica that cannot be reached gets one retry on another replica of its tier


@dataclass
class Call:
    """One admitted request on its way through a tier, and what it has used so far."""

    request_id: str
    principal: Principal
    req: ChatCompletionRequest
    arrived: float  # time.time()
    t0: float  # time.perf_counter() at arrival
    route: Route | None = None
    admitted: Admitted | None = None
    degradation: Degradation | None = None
    ticket: Ticket | None = None
    replica: Replica | None = None
    upstream_t0: float | None = None
    upstream_s: float = 0.0
    ttft_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    busy_s: float | None = None
    finish_reason: str | None = None
    settled: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # the client's request headers (lower-case names)
    text_parts: list[str] = field(default_factory=list)  # the answer as it streams, for the cache
    cache_result: Any = None  # Hit | Miss | Bypass
    cache_scope: Any = None
    cache_policy: Any = None
    cache_headers: dict[str, str] = field(default_factory=dict)
    cache_body: dict[str, Any] = field(default_factory=dict)  # the OpenAI body as the cache keyed it
    affinity: str | None = None  # the conversation's key for replica affinity
    want_logprobs: bool = False  # ask the upstream for token log-probabilities (the cascade's check)
    logprob_sum: float = 0.0
    logprob_n: int = 0
    cascade: str | None = None  # `small->mid`: the answer came from a cascade (x-tiergate-cascade)
    cascade_of: str | None = None  # the first attempt's request id, on a cascade's second attempt

    @property
    def is_cache_hit(self) -> bool:
        return self.admitted is not None and self.admitted.hit_price is not None

    @property
    def tier(self) -> TierSpec:
        assert self.route is not None
        return self.route.tier


class ChatService:
    def __init__(self, *, fleet: Fleet, client: TierClient, ledger: Ledger, metrics: GatewayMetrics,
                 admission: AdmissionService, queues: dict[str, TierQueue], signals: Signals | None = None,
                 cache: CacheService | None = None) -> None:
        self.cache = cache
        self.signals = signals or Signals()
        self.fleet = fleet
        self.client = client
        self.ledger = ledger
        self.metrics = metrics
        self.admission = admission
        self.queues = queues
        self._background: set[asyncio.Task[None]] = set()

    async def admit(self, call: Call) -> None:
        """Route and reserve (raises a refusal that charged nothing, and is counted in the ledger)."""
        try:
            call.admitted = await self.admission.admit(call)
        except TiergateError as err:
            self.ledger.submit_refusal(Refusal(call.request_id, call.arrived, call.principal.tenant.name,  # type: ignore[union-attr]
                                               call.principal.key.key_id, err.code or type(err).__name__,
                                               err.status_code))
            raise
        call.route = call.admitted.route

    async def start(self, call: Call) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any] | None]:
        """Wait for a dispatch slot, open the upstream stream and read its first chunk, so errors surface
        before any byte is sent. Returns the stream and its first chunk (None if the upstream sent nothing).
        Settles the call as an error when the tier fails here.
        """
        admitted = call.admitted
        assert admitted is not None
        queue = self.queues[call.tier.name]
        weight = admitted.plan.weight
        t_queue = time.perf_counter()
        try:
            call.ticket = await queue.acquire(call.principal.tenant.name,  # type: ignore[union-attr]
                                              priority=PRIORITY_ORDER[admitted.plan.priority], weight=weight,
                                              tokens=admitted.prompt_tokens + admitted.output_cap)
        except QueueFull as exc:
            err = Unavailable(str(exc), code="queue_full", retry_after=1)
            self.metrics.refused("queue_full")
            await self.settle(call, "error", err.status_code, error_code=err.code)
            raise err from exc
        except asyncio.CancelledError:
            await self.settle(call, "cancelled", 499, wait=False)
            raise
        waited = time.perf_counter() - t_queue
        self.metrics.queue_wait.labels(call.tier.name).observe(waited)
        self.signals.queue_wait(waited)
        last: TiergateError | None = None
        tried: set[int] = set()
        if call.affinity is None:
            call.affinity = affinity_key(call.principal.tenant.name,  # type: ignore[union-attr]
                                         [{"role": m.role, "content": m.text()} for m in call.req.messages],
                                         call.headers.get(SESSION_HEADER))
        for _ in range(MAX_ATTEMPTS):
            try:
                call.replica, _why = self.fleet.pick(call.tier.name, exclude=tried, affinity=call.affinity)
            except NoTierAvailable as exc:
                last = last or map_tier_error(exc)
                break
            tried.add(call.replica.index)
            stream = self._stream(call)
            try:
                first = await anext(stream, None)
                return stream, first
            except UpstreamUnreachable as exc:
                call.replica.mark("down", f"unreachable: {exc}")
                last = map_tier_error(exc)
            except TierError as exc:
                last = map_tier_error(exc)
                break
        assert last is not None
        await self.settle(call, "error", last.status_code, error_code=last.code)
        raise last

    async def _stream(self, call: Call) -> AsyncIterator[dict[str, Any]]:
        """The upstream's chunks; the outcome goes to the replica's breaker, latency average and affinity."""
        replica = call.replica
        assert replica is not None and replica.url is not None
        body = self._upstream_body(call)
        replica.inflight += 1
        call.upstream_t0 = time.perf_counter()
        verdict: bool | None = None  # True: the replica answered; False: it failed; None: nobody knows
        try:
            async for chunk in self.client.stream_chat(replica.url, body, api_key=self.fleet.api_key(call.tier)):
                self._account(call, chunk)
                yield chunk
            verdict = True
        except UpstreamRejected as exc:
            verdict = exc.status < 500  # a client error is a healthy replica's answer
            if not verdict:
                replica.breaker.failure(f"answered {exc.status}")
            raise
        except TierError as exc:
            verdict = False
            replica.breaker.failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            replica.inflight -= 1
            call.upstream_s = time.perf_counter() - call.upstream_t0
            if verdict:
                replica.breaker.success()
            if verdict is None:  # cancelled: no verdict, but a half-open probe must not stay claimed
                replica.breaker.abandon()
            elif verdict and call.finish_reason is not None:
                replica.observe_latency(call.upstream_s)
                self.fleet.served(call.affinity, replica)

    async def answer(self, call: Call) -> tuple[Call, str]:
        """A non-streaming answer, settled; cascaded once to the next dearer tier when the plan says so and
        the answer fails its check. Returns the attempt whose answer the client gets, and its text.

        Streaming requests are not cascaded: their first tokens are with the client before the answer can
        be judged, and a second answer cannot be taken back into the same stream.
        """
        stream, first = await self.start(call)
        text = await self.collect(call, stream, first)
        admitted = call.admitted
        assert admitted is not None and call.route is not None
        routing = admitted.plan.routing
        if not (routing.cascade and call.route.auto):
            await self.settle(call, "ok", 200)
            return call, text
        verdict = check_answer(text, finish_reason=call.finish_reason, cap_by_context=admitted.cap_by_context,
                               mean_logprob=call.logprob_sum / call.logprob_n if call.logprob_n else None,
                               min_mean_logprob=routing.cascade_min_mean_logprob)
        target = None if verdict is None else next_dearer(
            self.fleet.catalogue, call.tier, admitted.plan.allowed_tiers, self.fleet.unavailable(), verdict)
        if verdict is None or target is None or admitted.degradation.cascade_disabled:
            if verdict is not None:
                call.cache_scope = None  # an answer that failed its check is not worth keeping
                if admitted.degradation.cascade_disabled:
                    admitted.degradation.applied.append("disable_cascade")
                    call.route = replace(call.route, reason=f"{call.route.reason}; {verdict.why}, not cascaded "
                                                            f"(degrade level {admitted.degradation.level})")
                else:
                    call.route = replace(call.route, reason=f"{call.route.reason}; {verdict.why}, no dearer "
                                                            "tier to cascade to")
            await self.settle(call, "ok", 200)
            return call, text
        return await self._cascade(call, text, target, verdict.why, verdict.code)

    async def _cascade(self, call: Call, text: str, target: TierSpec, why: str, code: str) -> tuple[Call, str]:
        admitted = call.admitted
        assert admitted is not None and call.route is not None
        label = f"{call.tier.name}->{target.name}"
        second = Call(f"{call.request_id}-cascade", call.principal, call.req, call.arrived, time.perf_counter(),
                      degradation=call.degradation, headers=call.headers, affinity=call.affinity,
                      cascade=label, cascade_of=call.request_id)
        route = Route(target, f"cascade from {call.tier.name} ({why})", auto=True)
        call.cache_scope = None  # the failed answer is not cached; nor is the second (keyed for the first tier)
        try:
            second.admitted = await self.admission.admit_on(second, admitted.plan, route, admitted.degradation,
                                                            admitted.requested_tier)
        except TiergateError as err:  # over budget or limits for a second attempt: the first answer stands
            call.route = replace(call.route, reason=f"{call.route.reason}; {why}, cascade to {target.name} "
                                                    f"refused ({err.code})")
            await self.settle(call, "ok", 200)
            return call, text
        second.route = route
        call.route = replace(call.route, reason=f"{call.route.reason}; {why}: cascaded to {target.name} "
                                                f"as {second.request_id}")
        await self.settle(call, "ok", 200)
        self.metrics.cascades.labels(call.tier.name, target.name, code).inc()
        try:
            stream, first = await self.start(second)
            better = await self.collect(second, stream, first)
        except TiergateError as err:  # the retry failed (and is settled as such): the first answer stands
            call.cascade = f"{label} failed ({err.code})"
            return call, text
        await self.settle(second, "ok", 200)
        return second, better

    async def collect(self, call: Call, stream: AsyncIterator[dict[str, Any]], first: dict[str, Any] | None) -> str:
        """Read the whole answer; a failure or cancellation settles the call and propagates."""
        parts: list[str] = []
        try:
            chunk = first
            while chunk is not None:
                for choice in chunk.get("choices") or []:
                    parts.append((choice.get("delta") or {}).get("content") or "")
                chunk = await anext(stream, None)
        except TierError as exc:
            err = map_tier_error(exc)
            await self.settle(call, "error", err.status_code, error_code=err.code)
            raise err from exc
        except asyncio.CancelledError:
            await stream.aclose()
            await self.settle(call, "cancelled", 499, wait=False)
            raise
        return "".join(parts)

    def _upstream_body(self, call: Call) -> dict[str, Any]:
        admitted = call.admitted
        assert admitted is not None
        body = call.req.model_dump(exclude_none=True, exclude={"model", "stream", "stream_options", "priority",
                                                               "max_completion_tokens"})
        tier = call.tier
        body["model"] = tier.name if tier.backend == "local" else tier.model
        body["max_tokens"] = admitted.output_cap  # never more than the reservation covers
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        body["priority"] = PRIORITY_ORDER[admitted.plan.priority]
        routing = admitted.plan.routing
        if routing.cascade and routing.cascade_min_mean_logprob is not None and not call.req.stream:
            body["logprobs"] = call.want_logprobs = True  # our engine and vLLM both return them
        return body

    def _account(self, call: Call, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            call.input_tokens = int(usage.get("prompt_tokens") or call.input_tokens)
            call.output_tokens = int(usage.get("completion_tokens") or call.output_tokens)
        ext = chunk.get("x_tiergate")
        if isinstance(ext, dict) and "busy_s" in ext:
            call.busy_s = float(ext["busy_s"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                call.text_parts.append(delta["content"])
                if call.ttft_s is None:
                    call.ttft_s = time.perf_counter() - call.t0
            if choice.get("finish_reason"):
                call.finish_reason = choice["finish_reason"]
            if call.want_logprobs and choice.get("logprobs"):
                total, n = sum_logprobs([choice["logprobs"]])
                call.logprob_sum += total
                call.logprob_n += n

    async def settle(self, call: Call, status: str, http_status: int, *, error_code: str | None = None,
                     wait: bool = True) -> LedgerRow | None:
        """Write the call's one ledger row (durably, unless `wait` is False on a cancelled task)."""
        if call.settled:
            return None
        call.settled = True
        total_s = time.perf_counter() - call.t0
        tier = call.route.tier if call.route else None
        price = tier.price(call.input_tokens, call.output_tokens) if tier else Decimal(0)
        cache_saving = Decimal(0)
        if call.is_cache_hit:  # no model ran: the plan's hit price, and what the tier would have charged saved
            cache_saving = max(Decimal(0), price - call.admitted.hit_price)  # type: ignore[union-attr,operator]
            price = call.admitted.hit_price  # type: ignore[union-attr,assignment]
            compute, basis = Decimal(0), "cache"
        elif tier is None or call.upstream_t0 is None:
            compute, basis = Decimal(0), "none"
        elif call.busy_s is not None:
            compute, basis = tier.compute_cost(call.busy_s), "engine"
        else:
            compute, basis = tier.compute_cost(call.upstream_s or total_s), "wall"
        principal = call.principal
        requested = call.admitted.requested_tier if call.admitted else None
        route_saving = Decimal(0)
        catalogue = self.fleet.catalogue.tiers
        if tier is not None and requested in catalogue and requested != tier.name and not call.is_cache_hit:
            route_saving = max(Decimal(0), catalogue[requested].price(call.input_tokens, call.output_tokens) - price)
        row = LedgerRow(
            request_id=call.request_id, ts=call.arrived, tenant=principal.tenant.name,  # type: ignore[union-attr]
            key_id=principal.key.key_id, tier=tier.name if tier else None,
            model=(tier.model if tier else None), status=status, http_status=http_status,
            input_tokens=call.input_tokens, output_tokens=call.output_tokens, price_usd=price,
            compute_cost_usd=compute, cost_basis=basis, ttft_s=call.ttft_s, total_s=total_s,
            finish_reason=call.finish_reason, error_code=error_code,
            route_reason=call.route.reason if call.route else None,
            degrade_level=call.degradation.level if call.degradation else 0,
            degrade_actions=",".join(call.degradation.applied) if call.degradation and call.degradation.applied
            else None, requested_tier=requested, route_saving_usd=route_saving,
            cache_status=call.cache_result.status if call.cache_result is not None else None,
            cache_saving_usd=cache_saving, cascade_of=call.cascade_of)
        if row.cache_status is not None:
            self.metrics.cache.labels(row.tenant, row.cache_status).inc()
        if cache_saving > 0:
            self.metrics.cache_savings.labels(row.tenant).inc(float(cache_saving))
        if status == "ok" and self.cache is not None and not call.is_cache_hit:
            self.cache.save(call, "".join(call.text_parts))
        self.signals.outcome(http_status)
        overhead = total_s - call.upstream_s if call.upstream_t0 is not None else None
        self.metrics.finished(row, overhead)
        if call.ticket is not None:
            self.queues[tier.name].release(call.ticket, call.input_tokens + call.output_tokens)  # type: ignore[union-attr]
        quota = None
        if call.admitted is not None:
            used = 0 if call.is_cache_hit else call.input_tokens + call.output_tokens  # a hit runs no model
            quota = self.admission.quotas.settle(call.admitted.admission, tokens=used, price=price)
        if wait:
            if quota is not None:
                await quota
            await self.ledger.record(row)
        else:  # a cancelled task must not await: hand both writes off
            if quota is not None:
                task = asyncio.get_running_loop().create_task(quota)
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            self.ledger.submit(row)
        return row

    # ---- response shapes ----

    def client_chunk(self, call: Call, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The upstream chunk as the client sees it: our id and tier name, no internal fields."""
        out = {k: v for k, v in chunk.items() if k not in ("x_tiergate", "usage")}
        out["id"] = f"chatcmpl-{call.request_id}"
        out["model"] = call.tier.name
        if not out.get("choices"):
            if "usage" in chunk and call.req.include_usage:
                out["usage"] = chunk["usage"]
                return out
            return None
        choice = out["choices"][0]
        if not choice.get("delta") and not choice.get("finish_reason"):
            return None  # an empty delta that only carried usage upstream
        if call.req.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def completion(self, call: Call, text: str) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{call.cascade_of or call.request_id}",  # the client's request id, after a cascade too
            "object": "chat.completion", "created": int(call.arrived),
            "model": call.tier.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": call.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": call.input_tokens, "completion_tokens": call.output_tokens,
                      "total_tokens": call.input_tokens + call.output_tokens},
        }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return b"data: " + payload.encode() + b"\n\n"

