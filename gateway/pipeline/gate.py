"""The cheap per-tenant check every request passes before any work that costs: microseconds, in process.

The exact limits live in the quota backend (Redis across replicas) and are checked at reservation, after
routing, the cache lookup and token counting, which cost milliseconds (a long prompt's count holds a floor of its
tokens reserved first: gateway/pipeline/reserve.py's `floor`). A tenant flooding the gateway must not buy that work
for free, so before it:

- **Concurrency**: requests of a scope (the tenant, and a key with its own limits) in progress on this
  replica. This replica's count is a lower bound of the fleet's, so refusing at the limit refuses only
  what the exact check would refuse too. A request counts from the gate until its answer ends.
- **Request rate**: after the exact check refused a scope for its requests-per-minute, the scope is refused
  here for up to RATE_RECHECK_S, with the retry time that check named; then one request goes to the exact check
  again. Not until that time itself: a reservation undone (its answer lost, so the client's retry came as a new
  request; quotas/backends/redis.py cancels it) frees its place in the window early, and a replica that kept
  refusing on its own for the whole minute turned such a moment of double counting into places lost for good
  (on a loaded two-core host, up to 39 of the 100 an RPM limit allows across 4 replicas:
  tests/quotas/test_replicas.py beside busy processes).
- **Tokens and budgets**: the same for a scope the exact check refused for its tokens per minute or its daily or
  monthly budget, for up to RATE_RECHECK_S (never longer than the retry time it named), or until a reservation of
  the scope settles on this replica (`settled`: what it held beyond its use is free again). Those refusals fill
  no request window, so before this a tenant over its budget had every request routed, counted and looked up in
  the cache (an embedding on the queue every tenant shares) and then refused, uncharged and without end: 37 ms of
  CPU each, and another tenant's cache-path p50 went from 9.5 to 107 ms. Here a smaller request that would have
  fit, or one after another replica's settlement, may wait up to a second too: a policy, like the bucket below.
  A request no window or budget could ever admit (limit_errors.py `too_large`) is not remembered: it used nothing
  of the scope up, and here, before the parse, nothing tells it from the tenant's other requests, so remembering it
  (as "never_admitted", for a second) refused them all: one oversized request made the tenant's ordinary ones fail
  429 for a second. It is refused by its own size as soon as its prompt is counted, before its cache lookup
  (gateway/pipeline/handle.py), and charged to the bucket below as the tenant's fault, so a flood of them costs a
  parse and a count each, paid for, as a flood of prompts too long for the context does.

- **Refused bodies**: a body the validation refuses costs the event loop its parse (50-130 ms for one near the
  4 MiB limit) and charges nothing, so a tenant could send them without end. Each tenant has a bucket of
  REFUSED_BYTES_BURST bytes of refused bodies, refilled at REFUSED_BYTES_PER_S; while it is empty, the tenant's
  requests are refused here (429 `rate_limit_invalid_requests`) until it refills. This one is a policy, not the
  exact check's word: a client whose bodies are refused by the megabyte waits a few seconds. Small mistakes never
  reach it (a thousand 1 KB bodies refused a second refill it). A refused request is charged its headers too
  (`refused_size`: a body of `{}` under 60 KB of headers cost the app more than its body), and a request the tier
  refuses as the tenant's fault (a 4xx of its validation the gateway relays) is charged as one the gateway refused.
  So is every refusal of the request's own fault after its parse (gateway/pipeline/refusals.py's `tenants_fault`:
  a model not found or not allowed, a prompt too long for the context, an idempotency conflict, a request no window
  or budget could ever admit): those charged nothing either and filled no request window (that is charged at
  reservation), and a tenant with an RPM of 3 had 40 bodies of 4 MiB parsed and refused in 0.6 s, and prompts of
  331k spaces counted in full (163 ms of CPU each) and refused, without end, while another tenant's p95 went from
  15 to 168 ms. A prompt tokenized before it was refused is charged TOKENIZED_CHAR_BYTES bytes a character
  tokenized besides its body (tokenizing a character costs 0.5-2 us, parsing a byte about 1 ns): a bucket refilling
  at 1 MiB/s then pays for about 65k characters of refused counts a second (a few percent of a core), and 331k
  spaces empty most of it at once, while a client's occasional prompt too long (its prefix of at most `context x 8`
  characters counted) costs it a few hundred kilobytes.

A refusal here costs a dictionary lookup and charges nothing; it is the exact check's 429, headers and all
(gateway/pipeline/limit_errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.errors import RateLimited
from gateway.pipeline.limit_errors import limit_refusal
from quotas.plans import Limits

log = logging.getLogger("tiergate.gate")

RATE_RECHECK_S = 1.0  # the longest a scope is refused here on the exact check's word before it is asked again
REMEMBERED_REASONS = frozenset({"rpm", "tpm", "budget_day", "budget_month"})  # not concurrency: it frees in moments
REFUSED_BYTES_PER_S = 1 << 20  # refused bodies a tenant may send a second, on average (bytes)
REFUSED_BYTES_BURST = 8 << 20  # and at once: two bodies at the size limit
TOKENIZED_CHAR_BYTES = 16  # what a refused request is charged for each character of its prompt it had tokenized


@dataclass(frozen=True)
class Scope:
    """One limited scope: the tenant ("t"), or a key with its own limits ("k:<id>")."""

    name: str  # "<tenant>" or "<tenant>/k:<key id>"
    label: str  # "your tenant" or "your key", for messages
    limits: Limits


class Pass:
    """A request inside the gate; `leave` (exactly once, in a `finally`) frees its concurrency places.

    A route enters the gate before it reads the request's body (`Pipeline.admit`): a tenant's connections past its
    concurrency are refused there, their bodies unread, where each had its body of up to `max_body_bytes` read into
    memory first, however many it opened. The request path that it hands the pass to marks it `taken` as it starts,
    and leaves it in its `finally`; until then (the body not whole, the client gone before the path started) the
    route leaves it.

    A route may also `hold` it until its answer's body is handed over to the client (gateway/middleware.py
    `hold_until_sent`): the places are freed once both the path has left and the hold is let go (`let_go`), each
    once, whichever comes last. The path left as soon as its answer was ready, before a byte of a JSON body was
    written: a tenant allowed one request at a time whose client read none of its answers had as many answers of
    megabytes held in the gateway's memory at once as it liked (tests/gateway/test_whole_answer_holds_place.py).

    A held pass also keeps its request's concurrency slots in the quota store (`keeps`: Redis, shared by every
    replica), freed with its places: the gate's places are this replica's alone, and the store's slots, freed at the
    settle, before the body was written, let a tenant allowed one request at a time have an answer unread on each
    replica at once (tests/gateway/test_quota_slot_held_until_sent.py). A store that does not free a slot at once
    (Redis) frees it in a task begun as the places are freed; `releasing` says which the store has not answered yet,
    so that the middleware writes the answer's last piece once it has (gateway/middleware.py `_send_last`)."""

    def __init__(self, gate: TenantGate, scopes: tuple[Scope, ...]) -> None:
        self._gate = gate
        self._scopes = scopes
        self._left = False  # its places are free
        self._over = False  # the request path (or the route, before it) has left
        self._held = False  # a route holds it until its answer's body is sent
        self._request_id: str | None = None  # the request it is held for, as the gate knows it (`TenantGate.held`)
        # what frees the quota slots it keeps, each called once; and the releases those began, not yet seen done
        self._kept: list[Callable[[], asyncio.Future[None] | None]] = []
        self._releasing: list[asyncio.Future[None]] = []
        self.taken = False  # the request path owns it now, and leaves it

    def hold(self, request_id: str | None = None) -> None:
        """Keep the places past `leave` until `let_go`; before the path starts. `request_id`: the request's, under
        which the gate finds it until its places are free (`TenantGate.held`), so the quota slots its request
        reserves are kept with them (`keeps`)."""
        self._held = True
        if request_id is not None and not self._left:
            self._request_id = request_id
            self._gate._holding[request_id] = self

    def keeps(self, release: Callable[[], asyncio.Future[None] | None]) -> bool:
        """Call `release` (which frees a quota slot of its request; it must not raise) once, as its places are freed:
        whether it will (False: they are free already, and the caller frees the slot itself). What `release` returns:
        None (freed), or what is done once the store has answered (`releasing`; never failed, never to be cancelled:
        quotas/reservations.py `QuotaService.release_slot`)."""
        if self._left:
            return False
        self._kept.append(release)
        return True

    def leave(self) -> None:
        self._over = True
        self._free()

    def let_go(self) -> None:
        """The hold's end (the answer's body handed over, or the request over however it ended)."""
        self._held = False
        self._free()

    def releasing(self) -> list[asyncio.Future[None]]:
        """The releases of its quota slots begun as its places were freed (by `leave` or `let_go`) that the store has
        not answered yet; none before they are freed."""
        if self._releasing:
            self._releasing = [r for r in self._releasing if not r.done()]
        return self._releasing

    def _free(self) -> None:
        if self._left or self._held or not self._over:
            return
        self._left = True
        if self._request_id is not None:
            self._gate._holding.pop(self._request_id, None)
        try:
            for scope in self._scopes:
                self._gate._leave(scope.name)
        finally:
            while self._kept:  # each once, whatever another does
                release = self._kept.pop()
                try:
                    begun = release()
                except Exception:
                    log.exception("freeing a quota slot of a request that ended failed (its lease frees it)")
                else:
                    if begun is not None:
                        self._releasing.append(begun)


class TenantGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, refused_bytes_per_s: float = REFUSED_BYTES_PER_S,
                 refused_bytes_burst: float = REFUSED_BYTES_BURST) -> None:
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        # scope -> (ask the exact check again at, retry at, why: "rpm", "tpm", "budget_day" or "budget_month")
        self._rate_refused: dict[str, tuple[float, float, str]] = {}
        self.refused_bytes_per_s = refused_bytes_per_s
        self.refused_bytes_burst = refused_bytes_burst
        self._refused: dict[str, tuple[float, float]] = {}  # tenant -> (bytes left in its bucket, when last filled)
        self._holding: dict[str, Pass] = {}  # request id -> its held pass, until its places are free (`Pass.hold`)

    def enter(self, scopes: tuple[Scope, ...]) -> Pass:
        """Admit a request into the gate, or raise the 429 the exact check would give (or the refused bodies')."""
        now = self._clock()
        if scopes and (left := self._bucket(scopes[0].name, now)) < 0:
            retry = max(1, math.ceil(-left / self.refused_bytes_per_s))
            raise RateLimited(f"rate limit of {scopes[0].label} reached: too many requests refused (invalid, too "
                              f"long, or not allowed); fix them, and retry in {retry}s",
                              code="rate_limit_invalid_requests", retry_after=retry)
        for scope in scopes:
            refused = self._rate_refused.get(scope.name)
            if refused is not None:
                recheck, until, reason = refused
                if now < recheck:
                    raise limit_refusal(scope.label, reason, until - now, scope.limits)
                del self._rate_refused[scope.name]
            limit = scope.limits.max_concurrent
            if limit is not None and self._in_flight.get(scope.name, 0) >= limit:
                raise limit_refusal(scope.label, "concurrency", 1, scope.limits)
        for scope in scopes:
            self._in_flight[scope.name] = self._in_flight.get(scope.name, 0) + 1
        return Pass(self, scopes)

    def rate_refused(self, scope_name: str, retry_after_s: float, reason: str = "rpm") -> None:
        """The exact check refused `scope_name` for `reason` (REMEMBERED_REASONS: a limit used up) until
        `retry_after_s` from now."""
        now = self._clock()
        self._rate_refused[scope_name] = (now + min(retry_after_s, RATE_RECHECK_S), now + retry_after_s, reason)

    def settled(self, tenant: str, scopes: tuple[str, ...]) -> None:
        """A reservation of `tenant` in `scopes` ("t", "k:<id>") settled: tokens and budget it held beyond its use
        are free, so a remembered refusal for them may no longer hold (one for the request rate still does)."""
        for scope in scopes:
            name = tenant if scope == "t" else f"{tenant}/{scope}"
            if (held := self._rate_refused.get(name)) is not None and held[2] != "rpm":
                del self._rate_refused[name]

    def body_refused(self, tenant: str, size: int) -> None:
        """A request of `tenant` was refused as its own fault, charged `size` bytes (`refused_size`): taken from
        its bucket."""
        now = self._clock()
        self._refused[tenant] = (self._bucket(tenant, now) - size, now)

    def _bucket(self, tenant: str, now: float) -> float:
        """What is left in `tenant`'s bucket of refused bytes now (negative: refused until it refills)."""
        if (held := self._refused.get(tenant)) is None:
            return self.refused_bytes_burst
        left, at = held
        left = min(self.refused_bytes_burst, left + (now - at) * self.refused_bytes_per_s)
        if left >= self.refused_bytes_burst:
            del self._refused[tenant]  # full again: nothing to remember
        return left

    def in_flight(self, scope_name: str) -> int:
        return self._in_flight.get(scope_name, 0)

    def held(self, request_id: str) -> Pass | None:
        """The pass held for `request_id` (`Pass.hold`) while its places are not free: what keeps the quota slots
        that request reserves until its answer is handed over (gateway/pipeline/reserve.py)."""
        return self._holding.get(request_id)

    def _leave(self, name: str) -> None:
        left = self._in_flight.get(name, 0) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)


def refused_size(body: bytes, headers: Mapping[str, str], tokenized_chars: int = 0) -> int:
    """What a refused request is charged to its tenant's bucket: its body's bytes and its headers' (a line each), and
    TOKENIZED_CHAR_BYTES for each character of its prompt tokenized before it was refused."""
    return (len(body) + sum(len(name) + len(value) + 4 for name, value in headers.items())
            + tokenized_chars * TOKENIZED_CHAR_BYTES)


def scopes_of(tenant: str, key_id: str, plan_limits: Limits, key_limits: Limits | None) -> tuple[Scope, ...]:
    """The tenant's scope and, where the key has limits of its own, the key's."""
    scopes = [Scope(tenant, "your tenant", plan_limits)]
    if key_limits is not None:
        scopes.append(Scope(f"{tenant}/k:{key_id}", "your key", key_limits))
    return tuple(scopes)
