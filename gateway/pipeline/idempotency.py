"""Idempotency: a request with an `Idempotency-Key` header runs once per tenant and key.

The OpenAI SDKs retry a request whose answer was lost (a timeout, a dropped connection) with the same
`Idempotency-Key`; without this the tenant would pay twice. POST /v1/embeddings runs the same stage, its route in
the fingerprint, storing its vectors compactly (gateway/embeddings_service.py). As Stripe does it:
- the key's first request claims it and runs; its answer is stored with its ledger row (quotas/idempotency.py)
  for the plan's `idempotency_ttl_s` (24 h by default);
- a retry after that gets the stored answer (the same id, body and usage; as JSON, or replayed as a stream),
  with `x-tiergate-idempotent-replay: true`, charged nothing and written nowhere, but counted in the tenant's
  request rate as any request (handle.py's `_count_replay`), and told its own `x-ratelimit-*` headers (never the
  first answer's: they are not stored);
- a retry while the first still runs waits for it, up to `wait_s`, then gets 409 with Retry-After. The first's
  claim has a lease (`lease_s`, so a claim whose gateway died frees its key), renewed every third of it while the
  request runs (`IdempotencyStage.renewing`), and a renewal that failed is tried again every thirtieth of it until one
  succeeds: not renewed, an answer longer than its lease (a long stream) let a retry take the key over, run and be
  charged a second time. A lease that could not be renewed before it may end (the store failing all that while) is
  lost: its request is stopped (`Keep`), settled as a client that left is (billed for what ran), and its client told
  503 `idempotency_lease_lost`; it went on, and a retry that took the key over ran and was charged too;
- while the ledger cannot write (its readiness, gateway/pipeline/handle.py), a stored answer is still replayed, read
  only (`IdempotencyStage.stored`: a replay writes no row); anything else, a new claim included, is a 503;
- the same key with another body is a 422 naming the header;
- an answer that failed, or whose client left, is not stored: the claim is given up and a retry runs again;
- an answer whose ledger row was not durable in time (the ledger's wait ran out: a slow disk, a database that
  cannot commit now) is a 503 to its client, but the row is still queued and may commit later, billed: its claim is
  not given up then but handed to `keep_when_written`, which waits for the row's final outcome. A row that commits
  keeps its answer (committed with it, or stored after it in Redis), so a retry waits or gets 409 meanwhile, then the
  replay; a row refused for good gives the claim up, so a retry runs. Given up at once, a row that committed later
  billed the tenant with no answer kept, and the retry ran and was billed again;
- what a tenant holds is bounded (quotas/idempotency.py's `Limits`: 10,000 live keys, 256 MiB of stored answers):
  at the bound a new key is refused with 429 `idempotency_key_limit` and a Retry-After (until its first record
  expires), here, before anything is counted, charged or stored; a replay, or a key already held, still answers.
  Without it, a cached answer repeated under fresh keys, free, stored a copy per key for 24 h and filled the
  ledger's disk for every tenant. An answer over 4 MiB is answered but not stored: its key is kept as answered, and a
  retry is told so (409 `idempotency_answer_not_kept`, `_replayable`), never run and charged again;
- the records' store failing to claim a key is a 503 `idempotency_unavailable` with Retry-After, before anything is
  counted, charged or run, on every store (its `LedgerUnavailable`: Redis unreachable, quotas/idempotency_redis.py;
  SQLite busy, read-only, full or failing its I/O, quotas/idempotency_sqlite.py; PostgreSQL unreachable, deadlocked,
  timed out or read-only, a claim whose reply was lost given up, quotas/idempotency_postgres.py). Once a request is
  answered, written and settled, its answer is handed to the store and its claim never given up: a store that fails then
  does not fail the answer (Redis owes the write and keeps the key claimed meanwhile, see its module), so a retry
  replays it or waits, never runs and is billed again.

This module claims a key and replays or stores its answer (`IdempotencyStage`); what the request path holds between
the claim and the store, the claim's lifetime and the row-following hand-off (`Keep`, `keep_when_written`,
`lease_lost`), is idempotency_keep.py's, re-exported here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from typing import Any

from pydantic import BaseModel

from cache.scope import identity_snapshot
from gateway.errors import Conflict, RateLimited, Unavailable, Unprocessable
from gateway.pipeline.context import RequestContext
from gateway.pipeline.events import Delta, Done, Event, Head
from gateway.pipeline.handed_off import HandedOff
from gateway.pipeline.idempotency_keep import Keep as Keep  # re-exported, as the two below: callers import them
from gateway.pipeline.idempotency_keep import keep_when_written as keep_when_written
from gateway.pipeline.idempotency_keep import lease_lost as lease_lost
from gateway.pipeline.meter import Outcome
from gateway.request_headers import check_idempotency_key
from quotas.idempotency import LOST, UNKNOWN, Claim, Full, IdempotencyStore, Mismatch, Replay, Running, not_kept
from quotas.ledger import LedgerUnavailable
from wire.chat_request import ChatCompletionRequest

HEADER = "idempotency-key"
REPLAY_HEADER = "x-tiergate-idempotent-replay"
log = logging.getLogger("tiergate.idempotency")
RENEW_RETRY_PARTS = 30  # a renewal that failed is tried again this part of the lease later (20 s of the default 600)
# a lease is counted on until this part of it before it can end by this gateway's clock (20 s of the default 600): the
# margin for a store's clock that runs apart from this gateway's (PostgreSQL's and Redis' date leases by their own), or
# a wall clock stepped
LEASE_MARGIN_PARTS = 30


def _replayable(replay: Replay) -> Replay:
    """The stored answer, or a 409 where the store kept only that the key's request ran and answered (its answer was
    over the store's bound for one: `NOT_KEPT`): it is neither replayed nor run again, which billed it a second time."""
    size = not_kept(replay.answer)
    if size is None:
        return replay
    if replay.answer.get(UNKNOWN):  # its gateway died, and wrote its row, if any, in a ledger not readable here
        raise Conflict("Idempotency-Key: the request with this key was taken by another gateway, which stopped before "
                       "keeping its answer; that gateway keeps its own usage ledger, which this one cannot read, so "
                       "whether the request ran and was billed is not known here. It is not run again under this "
                       "key: send the request with a new key to run it", param="Idempotency-Key",
                       code="idempotency_answer_not_kept")
    if replay.answer.get(LOST):  # its gateway stopped between the row and the answer's record (quotas/idempotency.py)
        raise Conflict("Idempotency-Key: the request with this key ran and was billed, but its answer was lost (its "
                       "gateway stopped before keeping it); send the request with a new key to run it again",
                       param="Idempotency-Key", code="idempotency_answer_not_kept")
    raise Conflict(f"Idempotency-Key: the request with this key ran, was answered and billed, but its answer "
                   f"({size / 2**20:.1f} MiB) was too large to keep for a replay; send the request with a new key to "
                   "run it again", param="Idempotency-Key", code="idempotency_answer_not_kept")


class IdempotencyStage:
    def __init__(self, store: IdempotencyStore, *, wait_s: float = 10.0, lease_s: float = 600.0,
                 poll_s: float = 0.1) -> None:
        self.store = store
        self.wait_s = wait_s
        self.lease_s = lease_s  # a claim whose owner never finishes (a killed gateway) frees the key after this
        self.poll_s = poll_s
        # claims whose request left, and their abandons
        self._handed = HandedOff(log, "giving up the Idempotency-Key claim of a request that left failed")
        self._asked: dict[Claim, float] = {}  # when each claim `begin` returned was asked of the store (monotonic)

    def _give_up(self, work: asyncio.Future[Any]) -> None:
        """A claim made for a request that left before it was told: given up (handed off), so a retry runs."""
        if work.cancelled() or work.exception() is not None or not isinstance(claim := work.result(), Claim):
            return  # nothing claimed (a store's failure to claim holds nothing for this request)
        self._handed.run(self.store.abandon(claim))

    async def drain(self) -> None:
        """Wait for claims of requests that left to be given up (shutdown, tests)."""
        await self._handed.drain()

    def renewing(self, claim: Claim) -> asyncio.Task[str]:
        """Renew `claim`'s lease every third of it while its request runs, off the request's path, until the request
        settles (`Keep.settle` cancels it). Without it an answer running longer than the lease (a long stream) let a
        retry with its key find the lease expired, take the key over, run and be charged again; renewed, the retry
        waits for it or gets 409, and a gateway that dies stops renewing, so its key is freed a lease later, as before.
        A renewal the store failed (busy, unreachable) is tried again a thirtieth of the lease later, not a third: a
        lease renewed on time has two thirds of itself left at the failure, some twenty tries, where two failures in a
        row let it end while its request still ran.

        The task ends by itself when the lease is lost (`Keep` then stops the request): no renewal has succeeded by the
        time it may end, or the store says the record is not this claim's running one any more (taken over by another
        request once it expired). When it may end is measured on this gateway's monotonic clock from when the last
        renewal that succeeded (or the claim) was asked of the store, as every store dates a lease no earlier than
        that (SQLite from the clock of the gateway that asks, PostgreSQL and Redis from their own on receipt), less a
        thirtieth of the lease (`LEASE_MARGIN_PARTS`): a store's clock may run apart from this gateway's."""
        asked = self._asked.pop(claim, None)  # a claim `begin` did not return (a test's): its lease from now
        return asyncio.get_running_loop().create_task(self._renew(claim, time.monotonic() if asked is None else asked))

    async def _renew(self, claim: Claim, asked: float) -> str:
        """Renewals until the lease is lost: why, returned (`renewing`)."""
        held_s = self.lease_s * (1 - 1 / LEASE_MARGIN_PARTS)
        held, failed = asked + held_s, 0  # until when the lease is surely the claim's; renewals failed in a row
        while True:
            await asyncio.sleep(min(self.lease_s / (RENEW_RETRY_PARTS if failed else 3), held - time.monotonic()))
            asked = time.monotonic()
            if asked >= held:
                return f"its lease could not be renewed before it may end ({failed} tries failed)"
            try:
                renewed = await asyncio.wait_for(self.store.renew(claim, self.lease_s), held - asked)
            except Exception as exc:  # the store failing for now: tried again soon, logged once a run of failures
                if time.monotonic() >= held:  # its wait for the store cut short by the lease's end
                    return f"its lease could not be renewed before it may end ({failed + 1} tries failed)"
                if not failed:
                    log.warning("renewing the lease of Idempotency-Key %r (tenant %s) failed, tried again every %g s "
                                "until it is: %s", claim.key, claim.tenant, self.lease_s / RENEW_RETRY_PARTS, exc)
                failed += 1
                continue
            if not renewed:  # answered (the request no longer runs for it), or another request's since it expired
                return "the store holds it as the claim of no running request"
            held = asked + held_s
            if failed:
                log.warning("the lease of Idempotency-Key %r (tenant %s) renewed after %d failed tries", claim.key,
                            claim.tenant, failed)
            failed = 0

    async def stored(self, ctx: RequestContext, req: BaseModel, *, route: str | None = None) -> Replay | None:
        """The key's stored answer, read only (nothing claimed, nothing written), or None: without the header, a key
        with no answer, another body, or the store failing. Asked while the ledger cannot write, when nothing that
        would write a row may start, but a replay writes none (gateway/pipeline/handle.py)."""
        keyed = self._keyed(ctx, req, route)
        if keyed is None:
            return None
        try:
            found = await self.store.stored(ctx.tenant, *keyed)
        except Exception as exc:  # the request is refused as it would be without the lookup
            log.warning("reading Idempotency-Key %r (tenant %s) while the ledger is not ready failed: %s", keyed[0],
                        ctx.tenant, exc)
            return None
        return _replayable(found) if isinstance(found, Replay) else None

    def _keyed(self, ctx: RequestContext, req: BaseModel, route: str | None) -> tuple[str, str] | None:
        """The request's key and fingerprint, or None without the header."""
        key = ctx.headers.get(HEADER)
        if key is None:
            return None
        check_idempotency_key(key)  # (as at the door, gateway/request_headers.py: for a caller that did not)
        # the route too: a text completion's body and a chat body can dump alike (its prompt_format is a default),
        # and a key used on one route never answers another's request
        route = route or getattr(req, "prompt_format", "chat")
        # and who asks, as the cache scopes it (gateway/pipeline/cache_lookup.py): the key's roles, and the end user
        # where the plan isolates users. Keys are per tenant, so another key of the tenant with other roles reusing
        # the key and body gets a 422, never this identity's answer. A role-less, unisolated identity adds nothing:
        # its fingerprints stay those stored before identities were part of them (its line begins "roles=", a route
        # never does, so the two forms cannot meet)
        isolate = ctx.plan.cache.isolate_users
        identity = identity_snapshot(ctx.principal.key.roles,
                                     getattr(req, "user", None) if isolate else None,
                                     getattr(req, "safety_identifier", None) if isolate else None)
        who = "" if identity == identity_snapshot() else f"{identity}\n"
        fingerprint = hashlib.sha256(
            f"{who}{route}\n{req.model_dump_json(exclude_unset=True)}".encode()).hexdigest()
        return key, fingerprint

    async def begin(self, ctx: RequestContext, req: BaseModel, *, route: str | None = None) -> Claim | Replay | None:
        """None without the header; else this request's claim, or the stored answer to replay. `route`: what the
        fingerprint says the request is (a chat request's own route when None; "embeddings" for that route's)."""
        keyed = self._keyed(ctx, req, route)
        if keyed is None:
            return None
        key, fingerprint = keyed
        deadline = time.monotonic() + self.wait_s
        while True:
            # shielded: a client that leaves while the store claims the key (SQLite's thread commits it, Redis has
            # run its script) leaves a claim no Keep owns yet; it is given up once the claim ends, never held for the
            # lease (a retry would wait, then get 409, for 10 minutes)
            asked = time.monotonic()
            work = asyncio.ensure_future(
                self.store.begin(ctx.tenant, key, fingerprint, ctx.request_id, lease_s=self.lease_s))
            try:
                begun = await asyncio.shield(work)
            except asyncio.CancelledError:
                self._handed.adopt(work, self._give_up)
                raise
            except LedgerUnavailable as exc:  # the store's own failure, not this request's: nothing was claimed
                raise Unavailable("Idempotency-Key: the idempotency records cannot be reached now; nothing was run or "
                                  "charged; retry shortly with the same key", param="Idempotency-Key",
                                  code="idempotency_unavailable", retry_after=1) from exc
            if isinstance(begun, Claim):
                self._asked[begun] = asked  # its lease dates from no earlier (`renewing`)
                return begun
            if isinstance(begun, Replay):
                return _replayable(begun)
            if isinstance(begun, Mismatch):
                raise Unprocessable("Idempotency-Key: this key was used with another request body; use a new key "
                                    "for a new request", param="Idempotency-Key", code="idempotency_key_reused")
            if isinstance(begun, Full):
                limits = self.store.limits
                raise RateLimited(f"Idempotency-Key: this tenant already holds {limits.records} idempotency keys or "
                                  f"{limits.bytes // 2**20} MiB of stored answers, the most it may; retry when some "
                                  "expire, or send the request without the header", param="Idempotency-Key",
                                  code="idempotency_key_limit", retry_after=math.ceil(begun.retry_after_s))
            assert isinstance(begun, Running)
            if time.monotonic() >= deadline:
                raise Conflict("Idempotency-Key: a request with this key is still running; retry later",
                               param="Idempotency-Key", code="idempotency_key_in_use", retry_after=1)
            await asyncio.sleep(self.poll_s)

    def ttl_s(self, ctx: RequestContext) -> float:
        return ctx.plan.idempotency_ttl_s

    @staticmethod
    def answer(head: Head, outcome: Outcome, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        """What is stored of an answer: enough to send it again, as JSON or as a stream."""
        headers = {k: v for k, v in head.headers.items() if not k.startswith("x-ratelimit-")}
        return {"id": head.response_id, "created": head.created, "model": head.model, "text": outcome.text,
                "finish_reason": outcome.finish_reason, "prompt_tokens": outcome.input_tokens,
                "completion_tokens": outcome.output_tokens, "logprobs": logprobs, "headers": headers,
                "tool_calls": [{"index": i, **call} for i, call in enumerate(outcome.tool_calls)] or None}

    @staticmethod
    def replay(req: ChatCompletionRequest, answer: dict[str, Any], limits: dict[str, str] | None = None) -> list[Event]:
        """The stored answer's events again. `limits`: the replay's own `x-ratelimit-*` headers (handle.py's
        `_count_replay`: the place it took in the request rate); the first answer's are never sent again (`answer`
        stores none, and any a record holds are dropped here), as they told counts of another time."""
        stored = {k: v for k, v in answer["headers"].items() if not k.startswith("x-ratelimit-")}
        headers = {**stored, **(limits or {}), REPLAY_HEADER: "true"}
        return [Head(answer["id"], answer["created"], answer["model"], headers, stream=req.stream,
                     include_usage=req.include_usage),
                Delta(answer["text"], answer.get("logprobs"), answer.get("tool_calls")),
                Done(answer["finish_reason"], answer["prompt_tokens"], answer["completion_tokens"])]
