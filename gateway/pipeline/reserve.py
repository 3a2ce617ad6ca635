"""Reserve: charge the request's quota scopes with an upper bound (prompt + output cap, at the tier's price;
or a cache hit's price), or refuse with what a client can act on. Nothing is charged on a refusal.

Its money is dated by the request's arrival (`ctx.arrived`), the instant that also dates its ledger row, so a
request arriving just before midnight counts for that day in both. The quota store bounds it by its own clock
(quotas/limits.py MAX_DATING_LAG_S): a reserve more than that after the arrival by the store's clock (a replica's
clock skewed by more) is dated that long before the store's clock instead. The reservation is settled to real use
by the settle stage, exactly once. A refusal for requests or tokens per minute or a spent budget is also told to
the gate, which then refuses the scope cheaply for up to a second (gateway/pipeline/gate.py).

A request no window or budget could ever admit (limit_errors.py `too_large`) is refused without asking the store
(`refuse_too_large`), and is not told to the gate: nothing of the scope is used up, and the gate's second refused
every request of the tenant after one, its ordinary ones too. It is the request's own fault, charged to the tenant's
bucket of refused requests (refusals.py `tenants_fault`), and the pipeline checks it as soon as the prompt is counted,
before the cache lookup (gateway/pipeline/handle.py), so a flood of them costs what a flood of prompts too long for
the context costs (a parse and a count, charged), not a lookup (but where the tier's tokenizer was not ready to count
it first: then it is counted, and refused here, after its lookup).

A request whose exact count is dear (a long prompt, gateway/pipeline/handle.py; many texts, the embeddings service)
first holds a floor of its tokens, the fewest it can need, while it is counted (`floor`): a tenant over its request
rate, its concurrency, a budget already spent, or tokens per minute too few for even the floor, is refused there,
its text never counted. The floor is given back at no use once the count ends, before the exact reservation, which
takes no second place in the request rate (`follows` the floor): what is settled is the exact reservation, as for a
request counted first.

The store's reserve runs shielded from the request: a client that leaves while it runs (Redis has run the script,
its reply not yet read) leaves a reservation no `finally` owns yet, so it is settled at zero use once the reserve
ends, handed off, never held for its lease (a tenant at its concurrency limit refused meanwhile).

A reservation's concurrency slot is kept past its settle, until its request's answer is handed over to its client,
where the request's place in the gate is held that long (`_keep_slot`): the settle writes the row and moves the money
before the answer is sent, as ever, and the store (Redis, shared by every replica) counts the request until its place
is given back. A floor's slot, and a cascade's first attempt's, are kept too: the reservation that follows takes it
over (`ReservationRequest.follows`), and their own release then frees nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

from gateway.errors import TiergateError, Unavailable
from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import REMEMBERED_REASONS, TenantGate
from gateway.pipeline.handed_off import HandedOff
from gateway.pipeline.limit_errors import limit_refusal, reset_duration, too_large
from quotas.backends.base import QuotaBackendError
from quotas.limits import Decision, Usage
from quotas.plans import Limits, Plan
from quotas.reservations import QuotaService, Reservation

log = logging.getLogger("tiergate.reserve")
FLOOR_SUFFIX = ":floor"  # a floor's quota request id: its request's id and this
GIVE_BACK_FLOOR_FAILED = "giving back the floor a request held while it was counted failed"


class ReserveStage:
    def __init__(self, *, quotas: QuotaService, gate: TenantGate) -> None:
        self.quotas = quotas
        self.gate = gate
        # reserves whose request left, and their give-backs
        self._handed = HandedOff(log, "giving back the reservation of a request that left failed")

    async def reserve(self, ctx: RequestContext, request_id: str, *, tokens: int, price: Decimal,
                      follows: str | None = None) -> Reservation:
        """`follows`: the reserved attempt this one continues (a cascade's retry): the client's request keeps the one
        rpm place and concurrency slot it was admitted with (under `max_concurrent: 1` a retry that took a slot of
        its own was always refused, and one that took a place counted the request twice against rpm). A request no
        window or period could ever admit (more tokens than a tokens-per-minute limit, a price over a whole budget)
        is refused first, saying so, without asking the store (`refuse_too_large`)."""
        refuse_too_large(ctx, tokens, price)
        decision, reservation = await self.attempt(ctx, request_id, tokens=tokens, price=price, follows=follows)
        if reservation is None:
            raise self.refused(ctx, decision)
        return reservation

    async def attempt(self, ctx: RequestContext, request_id: str, *, tokens: int, price: Decimal,
                      follows: str | None = None) -> tuple[Decision, Reservation | None]:
        """`reserve`, with a refusal answered (its decision), not raised nor told to the gate: for a caller whose
        refusal may be its estimate's, not the tenant's (embeddings' bound before counting); `refused` makes it
        the tenant's."""
        work = asyncio.ensure_future(self.quotas.reserve(
            request_id=request_id, tenant=ctx.tenant, plan=ctx.plan, key_id=ctx.key_id,
            key_limits=ctx.principal.key.limits, tokens=tokens, price=price,
            dated_at=ctx.arrived,  # the instant that dates the ledger row dates the money too
            follows=follows))
        try:
            decision, reservation = await asyncio.shield(work)
        except asyncio.CancelledError:  # the request left: what the reserve admits is nobody's, so it is given back
            self._handed.adopt(work, self._give_back)
            raise
        except QuotaBackendError as exc:
            raise Unavailable("the quota service is unavailable; retry shortly", code="quota_backend_unavailable",
                              retry_after=1) from exc
        if reservation is not None:
            self._keep_slot(ctx, reservation)
        return decision, reservation

    def _keep_slot(self, ctx: RequestContext, reservation: Reservation) -> None:
        """Where the request's place in the gate is held until its answer is handed over (gateway/middleware.py
        `hold_until_sent`), its reservation's concurrency slot is kept with it: its settle, before the answer's body
        is written, leaves the slot held, and the place's end frees it, once (`Pass.keeps`). Before the reservation
        can settle: no await since the store's answer."""
        entry = self.gate.held(ctx.request_id)
        if entry is not None and entry.keeps(lambda: self.quotas.release_slot(reservation)):
            self.quotas.keep_slot(reservation)  # (one no scope limits keeps nothing: its release does nothing)

    @asynccontextmanager
    async def floor(self, ctx: RequestContext, *, tokens: int, price: Decimal) -> AsyncIterator[str]:
        """Hold `tokens` at `price` (the fewest the request can reserve: nothing its count can go below) while the
        block counts it, or raise the refusal `reserve` raises; yields the floor's id, which the exact reservation
        follows (its rpm place is the request's). Given back at no use as the block ends, whatever ends it: awaited
        after a count (the exact reservation must not find its tokens still held), handed off after a failure or a
        cancel."""
        floor_id = ctx.request_id + FLOOR_SUFFIX
        held = await self.reserve(ctx, floor_id, tokens=tokens, price=price)
        try:
            yield floor_id
        except BaseException:
            self._handed.run(self.quotas.settle(held, tokens=0, price=Decimal(0)), GIVE_BACK_FLOOR_FAILED)
            raise
        await asyncio.shield(self._handed.run(self.quotas.settle(held, tokens=0, price=Decimal(0)),
                                              GIVE_BACK_FLOOR_FAILED))

    def refused(self, ctx: RequestContext, decision: Decision) -> TiergateError:
        """The refusal of a reservation `decision` denied, told to the gate (which refuses the scope cheaply for a
        while)."""
        if decision.reason in REMEMBERED_REASONS and decision.scope is not None:
            scope = ctx.tenant if decision.scope == "t" else f"{ctx.tenant}/{decision.scope}"
            self.gate.rate_refused(scope, decision.retry_after_s, decision.reason)
        return refusal(ctx.plan, decision, ctx.principal.key.limits)

    def _give_back(self, work: asyncio.Future[tuple[Decision, Reservation | None]]) -> None:
        """A reserve whose request left before it ended: a reservation it made is settled at zero use (handed off)."""
        if work.cancelled() or work.exception() is not None:
            return  # nothing admitted (a failed Redis reserve undoes what it may hold itself)
        _, reservation = work.result()
        if reservation is not None:
            self._handed.run(self.quotas.settle(reservation, tokens=0, price=Decimal(0)))

    async def drain(self) -> None:
        """Wait for reservations of requests that left to be given back (shutdown, tests)."""
        await self._handed.drain()


def refuse_too_large(ctx: RequestContext, tokens: int, price: Decimal, tokenized_chars: int = 0) -> None:
    """Raise `too_large`'s refusal (a `NeverAdmitted`, carrying `tokenized_chars`: the characters counted to know its
    `tokens`, which its charge includes) if no window or budget of the request's scopes could admit `tokens` at
    `price`. Told to no gate: a request of the same tenant that fits is admitted at once (the gate once refused every
    request of the scope for a second after one)."""
    key_limits, limits = ctx.principal.key.limits, ctx.plan.limits
    # (the plan's own checks inline first: every request passes here, and most keys have no limits of their own)
    if (key_limits is not None or (limits.tpm is not None and tokens > limits.tpm)
            or (limits.budget_day_usd is not None and price > limits.budget_day_usd)
            or (limits.budget_month_usd is not None and price > limits.budget_month_usd)) \
            and (never := too_large((("your tenant", limits), ("your key", key_limits)), tokens, price)):
        error = never[2]
        error.tokenized_chars = tokenized_chars
        raise error


def refusal(plan: Plan, decision: Decision, key_limits: Limits | None = None) -> TiergateError:
    """The 429 for a refused reservation, with OpenAI's `x-ratelimit-*` headers for the scope refused (the tenant's
    plan, or the key's own `key_limits`)."""
    if decision.scope and decision.scope.startswith("k:"):
        return limit_refusal("your key", decision.reason or "limit", decision.retry_after_s, key_limits)
    return limit_refusal("your tenant", decision.reason or "limit", decision.retry_after_s, plan.limits)


def ratelimit_headers(plan: Plan, decision: Decision, key_limits: Limits | None = None) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for an admitted request: for requests and for tokens, the scope with the
    least left (the tenant's, or its key's own limits: a key of rpm 1 under a plan of 600 was told 599 left)."""
    if key_limits is None:  # the tenant's scope alone (most keys): as before keys' limits were read here
        return _tenant_headers(plan.limits, decision.usage.get("t"))
    scopes = [(plan.limits, decision.usage.get("t"))]
    scopes += [(key_limits, usage) for scope, usage in decision.usage.items() if scope.startswith("k:")]
    requests = [(max(0, lim.rpm - use.requests), lim.rpm, use.reset_requests_s) for lim, use in scopes
                if use is not None and lim.rpm is not None]
    tokens = [(max(0, lim.tpm - use.tokens), lim.tpm, use.reset_tokens_s) for lim, use in scopes
              if use is not None and lim.tpm is not None]
    headers: dict[str, str] = {}
    if requests:
        left, limit, reset = min(requests)
        headers |= {"x-ratelimit-limit-requests": str(limit), "x-ratelimit-remaining-requests": str(left),
                    "x-ratelimit-reset-requests": reset_duration(reset)}
    if tokens:
        left, limit, reset = min(tokens)
        headers |= {"x-ratelimit-limit-tokens": str(limit), "x-ratelimit-remaining-tokens": str(left),
                    "x-ratelimit-reset-tokens": reset_duration(reset)}
    return headers


def _tenant_headers(limits: Limits, usage: Usage | None) -> dict[str, str]:
    """`ratelimit_headers` for the tenant's scope alone."""
    if usage is None:
        return {}
    headers = {}
    if limits.rpm is not None:
        headers |= {"x-ratelimit-limit-requests": str(limits.rpm),
                    "x-ratelimit-remaining-requests": str(max(0, limits.rpm - usage.requests)),
                    "x-ratelimit-reset-requests": reset_duration(usage.reset_requests_s)}
    if limits.tpm is not None:
        headers |= {"x-ratelimit-limit-tokens": str(limits.tpm),
                    "x-ratelimit-remaining-tokens": str(max(0, limits.tpm - usage.tokens)),
                    "x-ratelimit-reset-tokens": reset_duration(usage.reset_tokens_s)}
    return headers
