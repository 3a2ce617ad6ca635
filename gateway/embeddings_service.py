"""POST /v1/embeddings behind the same admission as chat: gate → parse → Idempotency-Key → degrade → reserve a bound
→ count → embed → ledger row → settle.

It reuses the chat pipeline's parts directly (the gate, `ReserveStage`, `RefusalLog`, the ledger, the quota
service) rather than the pipeline itself, whose route, cache, dispatch and settle stages are about a tier's
stream. What differs from chat:

- The model is the semantic cache's MiniLM (`cache.default_embedder()`: one model per process), run in the
  gateway. Its forward passes go through an `EmbeddingBatcher` of their own, so concurrent requests' texts
  share passes, and a large embeddings request never waits in line with (or holds up) the cache's lookups.
- Tokens are MiniLM's word pieces, the two special tokens included, up to the `max_tokens` the model reads:
  what it ran on. Cheap refusals come first: the reservation is made before any text is counted, of an upper bound
  that costs nothing to compute (per text, the lesser of `max_tokens` and `cache.embedder.token_bound`, which reads
  only the text's length and whether it is ASCII; that module says why it is one), at its price. A tenant over its
  rpm, tpm, concurrency or budget is refused there (429, or 402 for a spent budget), its texts never counted:
  counted first, a body of 4 MiB cost up to 19 s of the counting threads' CPU before its 429. Admitted, the texts
  are counted exactly and the request settles to that count, as chat settles prompt + max_tokens to its use (less,
  for a client that leaves; nothing for a request that failed; a client that leaves during the count, or a count
  that fails, is a row of its own at no tokens). A bound refused for tpm or a budget may be the bound's fault, not
  the tenant's (short texts are about a quarter of it): then `_count_first` reserves the floor (the two special
  tokens a text), which a tenant with no room left is refused for, still before any count; admitted, the texts
  are counted, the floor given back and the exact count reserved (taking no second rpm place: `follows`), or
  refused (429) as before. So a request whose exact count fits is never refused for its bound; a tenant with a
  little room left can still have a large body counted and refused, at the cost of an rpm place and a concurrency
  slot a time, as any request admitted.
- A request's texts are counted COUNT_PIECE_CHARS characters at a time, each piece a job of its own in the tenant's
  turn, as a chat prompt's count is about as long (gateway/pipeline/prompt.py): counted in one job, a body of 4 MiB
  held one of the two threads for all of it (512 texts of 8,192 characters: 2.6-3.6 s of ordinary words, 11-19 s of
  words the tokenizer splits slowly), and every other tenant's long prompts, embeddings and answer bodies waited
  behind it, or behind two.
- Price: the catalogue's `embeddings.price_per_1k_input` (tiers/catalogue.py says why it lives there). Compute
  cost: the catalogue's hardware rate over the wall time of the request's forward passes (`cost_basis`
  "wall", as for a remote tier that reports no busy time).
- One ledger row per admitted request, with `tier` "embeddings" and `model` the model's name; refusals before
  the reservation are counted as chat's are. The row is written, and the quota settled, exactly once, in the
  `finally` of `_answer`, whatever ends the request: its answer, an error, or the client leaving (`_settle`, in
  gateway/embeddings_settle.py).
- A client that leaves is noticed (the route's `ClientWatch`, as chat's): its texts still queued are dropped from
  the batches to come (only the forward pass running then, if any, runs on), and its row is `cancelled`, 499,
  billed, as a chat request is, for what ran: the word pieces of its texts whose vectors were ready when it left
  (none, if it left before its first). It was not sent them, but the model's time was spent on them, and
  leaving just before the answer must not make a request's compute free.
- `Idempotency-Key` as on chat (gateway/pipeline/idempotency.py's stage, with the same store and rules): the key's
  first request claims it and runs; a retry with the same body gets the stored answer with
  `x-tiergate-idempotent-replay: true`, charged nothing and written nowhere (counted in the request rate); 409 while
  the first still runs, 422 for another body (or a key used on another route: the route is in the fingerprint);
  the claim is given up when the request fails or its client leaves. The vectors are stored as base85 of their
  float32 (`pack_vectors`: 1,920 characters a vector, where JSON floats take about 8,000), so the answer to the
  largest request (2,048 texts, 3.75 MiB) fits the store's 4 MiB bound for one answer; an answer over the bound
  (a store configured smaller) is answered and not stored, as chat's: a retry runs again. They are packed in a
  counting thread (about 20 ms for the largest answer), before the request counts as answered: a client that leaves
  during the pack is `cancelled` as above, its answer not stored and its claim given up.
- The answer's body is JSON bytes built in the counting threads, tenants in turn (`wire.embeddings.embedding_body`:
  the bytes Litestar wrote for its dict before), in the same call as the pack: for 2,048 vectors about 16.6 MB and
  100 ms of work, which on the event loop stalled every tenant's requests. A replay's is built the same way, its
  vectors unpacked in the same call, so a tenant replaying a large answer over and over spends its own turns in those
  threads, not the loop. A client that leaves while its body is built is `cancelled` as one that leaves during the
  pack (a replay's: nothing is written; its place in the request rate stays taken).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

import numpy as np
from litestar import Litestar
from litestar.datastructures import State

from cache.batcher import EmbeddingBatcher
from cache.embedder import SPECIAL_TOKENS, Embedder, default_embedder, token_bound
from gateway.embedding_bodies import answer_body, replay_body
from gateway.embeddings_settle import EmbeddingsSettlement
from gateway.errors import InvalidRequest, NotFound, TiergateError, Unavailable, client_error, not_ready
from gateway.fair_threads import FairThreads
from gateway.ladder.apply import Degradation
from gateway.ladder.controller import LadderController
from gateway.metrics import GatewayMetrics
from gateway.pipeline.cache_lookup import check_data_version
from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import Pass, TenantGate, refused_size, scopes_of
from gateway.pipeline.handed_off import HandedOff
from gateway.pipeline.idempotency import HEADER as IDEMPOTENCY_HEADER
from gateway.pipeline.idempotency import REPLAY_HEADER, IdempotencyStage, Keep, lease_lost
from gateway.pipeline.limit_errors import NeverAdmitted
from gateway.pipeline.refusals import RefusalLog
from gateway.pipeline.reserve import ReserveStage, ratelimit_headers, refuse_too_large
from gateway.services import Services
from gateway.validation import parse_body
from quotas.idempotency import Claim, Replay
from quotas.ledger import Ledger
from quotas.reservations import QuotaService, Reservation
from tiers.catalogue import EmbeddingSpec
from wire.embeddings import EmbeddingRequest

COUNT_PIECE_CHARS = 1 << 16  # characters of a request's texts counted in one job of the counting threads
ROUTE = "embeddings"  # what the route adds to an Idempotency-Key's fingerprint (chat's is "chat" or "completion")
# a bound refused for these may be refused for the bound alone, where the exact count would fit (`_count_first`): a
# limit's, or a counter's bound (quotas/backends/base.py COUNTER_MAX) that only the bound would pass
TOKEN_REASONS = frozenset({"tpm", "budget_day", "budget_month", "overflow_tpm", "overflow_day", "overflow_month"})

log = logging.getLogger("tiergate.embeddings")

def _mark_ready(ready: list[bool], i: int, future: asyncio.Future[np.ndarray | None]) -> None:
    """Text i's vector came (its failure is read here, so a pass that failed every text of a batch logs nothing)."""
    ready[i] = not future.cancelled() and future.exception() is None


# X-Tiergate-Data-Version and X-Tiergate-Session mean nothing here (an embedding is never cached, so no data version
# scopes it; no tier serves it, so no session routes it), and a client that sets them on every request (the SDKs'
# `default_headers`) must not lose its embeddings for it, as with OpenAI-Organization: they are accepted and not
# read. A data version chat would refuse is refused here too (400 `invalid_header`): it was a 200.


class EmbeddingsService(EmbeddingsSettlement):
    """The service; its settlement (the ledger row, the quota, the kept answer) is its base's
    (gateway/embeddings_settle.py)."""

    def __init__(self, *, spec: EmbeddingSpec, embedder: Embedder, gate: TenantGate, reserve: ReserveStage,
                 refusals: RefusalLog, ledger: Ledger, quotas: QuotaService, metrics: GatewayMetrics,
                 ladder: LadderController | None, counting: FairThreads, max_batch: int = 32,
                 max_wait_s: float = 0.003, idempotency: IdempotencyStage | None = None) -> None:
        self.spec = spec
        self.counting = counting  # where texts are counted and answers packed, tenants in turn (the prompt stage's)
        self.embedder = embedder
        self.gate = gate
        self.reserve = reserve
        self.refusals = refusals
        self.ledger = ledger
        self.quotas = quotas
        self.metrics = metrics
        self.ladder = ladder
        self.idempotency = idempotency  # chat's stage (its store and rules); None: the header is refused
        self.batcher = EmbeddingBatcher(self._encode_many, max_batch=max_batch, max_wait_s=max_wait_s)
        self._handed = HandedOff(log, "work handed off by an embeddings request failed")

    def admit(self, ctx: RequestContext) -> Pass:
        """The request's place in its tenant's gate, or the gate's 429, counted: asked before the body is read, as
        chat's (gateway/pipeline/handle.py `Pipeline.admit`), and handed to `embed`."""
        with self.refusals.counted(ctx):
            return self.gate.enter(scopes_of(ctx.tenant, ctx.key_id, ctx.plan.limits, ctx.principal.key.limits))

    async def embed(self, ctx: RequestContext, body: bytes, entry: Pass | None = None) -> tuple[bytes, dict[str, str]]:
        """The answer to one embeddings request (its JSON body) and its headers (OpenAI's `x-ratelimit-*`; the replay
        header for an answer stored under its Idempotency-Key); raises a `TiergateError` (counted as a refusal before
        the reservation, written to the ledger after it). `entry`: its place in the gate, `admit`'s (entered here when
        None), left here once this starts (and freed where the route holds it only once the answer's body is sent:
        gateway/middleware.py `hold_until_sent`)."""
        entry = self.admit(ctx) if entry is None else entry
        entry.taken = True
        keep: Keep | None = None

        def charge(err: TiergateError) -> None:
            """A refusal of the request's own fault (a body that does not parse, a model not served, an
            Idempotency-Key reused, texts no window or budget could ever admit...): it cost its parse, maybe a count,
            and charges nothing else, so it is charged to the tenant's bucket of refused requests (gate.py), headers
            and all, and the characters counted, as chat's are (handle.py)."""
            tokenized = err.tokenized_chars if isinstance(err, NeverAdmitted) else 0
            self.gate.body_refused(ctx.tenant, refused_size(body, ctx.headers, tokenized))

        try:
            with self.refusals.counted(ctx, charge):
                req = self._parse(ctx, body)
                begun = await self._begin(ctx, req)
                if isinstance(begun, Replay):  # answered before: the same answer, charged nothing, written nowhere
                    return await self._replay(ctx, req, begun)
                keep = Keep(begun, self.idempotency.renewing(begun)) if begun is not None and self.idempotency else None
                self._refuse_if_degraded(ctx)
                reservation, counts = await self._admit(ctx, req.texts)
            answer = await self._answer(ctx, req, counts, reservation, keep)
            return answer, ratelimit_headers(ctx.plan, reservation.decision, ctx.principal.key.limits)
        except asyncio.CancelledError:
            if keep is not None and keep.stopped():  # its Idempotency-Key's lease lost: settled as cancelled
                raise lease_lost() from None
            raise
        finally:
            if keep is not None:
                keep.settle()
                if not keep.stored and self.idempotency is not None:  # a retry runs again
                    self._hand_off(self.idempotency.store.abandon(keep.claim))
            entry.leave()

    def _parse(self, ctx: RequestContext, body: bytes) -> EmbeddingRequest:
        """The cheapest checks first: readiness, the body, the model."""
        # a request with a key is let on while the ledger cannot write: its stored answer is replayed (`_begin`)
        if self.ledger.not_ready_reason is not None and (
                self.idempotency is None or IDEMPOTENCY_HEADER not in ctx.headers):
            raise not_ready()
        check_data_version(ctx.headers)  # (as chat checks it; not read: see above)
        req = parse_body(body, EmbeddingRequest)
        if not self.spec.enabled or req.model != self.spec.model:
            served = f"; this gateway serves {self.spec.model!r}" if self.spec.enabled else ""
            raise NotFound(f"no embedding model {req.model!r}{served}", param="model", code="model_not_found")
        return req

    async def _begin(self, ctx: RequestContext, req: EmbeddingRequest) -> Claim | Replay | None:
        """The request's claim on its Idempotency-Key, the stored answer to replay, or None without the header."""
        if self.idempotency is None:
            if IDEMPOTENCY_HEADER in ctx.headers:  # never dropped: a retry would run and be billed again
                raise InvalidRequest("Idempotency-Key is not supported on this gateway's embeddings",
                                     param="Idempotency-Key", code="unsupported_parameter")
            return None
        if self.ledger.not_ready_reason is not None:  # a replay writes no row: nothing else starts
            if (stored := await self.idempotency.stored(ctx, req, route=ROUTE)) is None:
                raise not_ready()
            return stored
        return await self.idempotency.begin(ctx, req, route=ROUTE)

    async def _replay(self, ctx: RequestContext, req: EmbeddingRequest,
                      replay: Replay) -> tuple[bytes, dict[str, str]]:
        """The stored answer, as it was sent. A replay takes its place in the tenant's request rate as chat's does
        (handle.py's `_count_replay`), at no tokens or money, and writes no row; its body is unpacked and built in a
        counting thread, in the tenant's turn (cancelled, as `_build`'s)."""
        reservation = await self.reserve.reserve(ctx, ctx.request_id, tokens=0, price=Decimal(0))
        self._hand_off(self.quotas.settle(reservation, tokens=0, price=Decimal(0)))
        answer = await self.counting.run(ctx.tenant, replay_body, replay.answer, req.encoding_format)
        headers = ratelimit_headers(ctx.plan, reservation.decision, ctx.principal.key.limits)
        return answer, {**headers, REPLAY_HEADER: "true"}

    def _refuse_if_degraded(self, ctx: RequestContext) -> None:
        """A priority class the ladder sheds, or answers from cache only, gets no fresh compute here either."""
        if self.ladder is None or self.ladder.level == 0:
            return
        degr = Degradation(self.ladder.level, tuple(self.ladder.actions()))
        priority = ctx.plan.priority
        if (shed := degr.shed(priority)) is not None:
            raise Unavailable(f"degradation level {degr.level}: {priority} traffic is shed; retry later",
                              code="degraded_shed", retry_after=shed.retry_after_s,
                              headers={"x-tiergate-degrade-actions": f"shed({priority})"})
        if degr.cache_only(priority):
            raise Unavailable(f"degradation level {degr.level}: {priority} traffic is answered from cache only, "
                              "and embeddings are never cached", code="degraded_cache_only", retry_after=30,
                              headers={"x-tiergate-degrade-actions": f"cache_only({priority})"})

    async def _admit(self, ctx: RequestContext, texts: list[str]) -> tuple[Reservation, list[int] | None]:
        """The request's reservation, of its bound before any text is counted (counts None: `_answer` counts them),
        or of its exact count where only the bound was refused (`_count_first`); else its refusal."""
        limit = self.embedder.max_tokens
        bound = sum(min(limit, token_bound(text)) for text in texts)
        decision, reservation = await self.reserve.attempt(ctx, ctx.request_id, tokens=bound,
                                                           price=self.spec.price(bound))
        if reservation is not None:
            return reservation, None
        if decision.reason not in TOKEN_REASONS:  # rpm, concurrency: the same however many tokens it has
            raise self.reserve.refused(ctx, decision)
        return await self._count_first(ctx, texts)

    async def _count_first(self, ctx: RequestContext, texts: list[str]) -> tuple[Reservation, list[int]]:
        """Where the bound did not fit the tenant's tokens or money: the floor (the special tokens of each text, what
        no text has fewer of) held while the texts are counted (`ReserveStage.floor`, as chat's long prompts hold
        theirs), refused to a tenant without room for even that, still uncounted; then the floor given back, and the
        exact count reserved in its place (its rpm place kept)."""
        floor = SPECIAL_TOKENS * len(texts)
        async with self.reserve.floor(ctx, tokens=floor, price=self.spec.price(floor)) as floor_id:
            counts = await self._count(ctx.tenant, texts)
        tokens = sum(counts)
        # more than a whole tpm or budget: charged (`charge`) the characters it had counted
        refuse_too_large(ctx, tokens, self.spec.price(tokens), sum(map(len, texts)))
        reservation = await self.reserve.reserve(ctx, ctx.request_id, tokens=tokens, price=self.spec.price(tokens),
                                                 follows=floor_id)
        return reservation, counts

    async def _count(self, tenant: str, texts: list[str]) -> list[int]:
        """`_num_tokens` of the texts, in the counting threads, a piece of about COUNT_PIECE_CHARS characters at a
        time (a text is never split), each in the tenant's turn: another tenant's job waits for a piece, not all."""
        counts: list[int] = []
        piece: list[str] = []
        chars = 0
        for text in texts:
            piece.append(text)
            chars += len(text)
            if chars >= COUNT_PIECE_CHARS:
                counts += await self.counting.run(tenant, self._num_tokens, piece)
                piece, chars = [], 0
        if piece:
            counts += await self.counting.run(tenant, self._num_tokens, piece)
        return counts

    def _num_tokens(self, texts: list[str]) -> list[int]:
        """Word pieces the model reads of each text (special tokens included)."""
        limit = self.embedder.max_tokens
        return [min(limit, self.embedder.num_tokens(t)) for t in texts]

    def _encode_many(self, texts: list[str]) -> list[np.ndarray | None]:
        return list(self.embedder.encode(texts))

    async def _answer(self, ctx: RequestContext, req: EmbeddingRequest, counts: list[int] | None,
                      reservation: Reservation, keep: Keep | None) -> bytes:
        """Count the texts (unless `counts` has them: `_admit`), embed them and build the answer's body, and settle
        once, whatever ends it: all of them (ok), an error (nothing billed: no vector was sent and the failure is
        ours), or the client leaving (cancelled: billed for the texts embedded; nothing while they are counted)."""
        tokens = 0
        ready = [False] * len(req.texts)  # which texts have their vector
        status, http_status, error_code, stored = "cancelled", 499, None, None
        t0 = time.perf_counter()
        wall_s: float | None = None  # the forward passes' (the compute cost's basis), the body's building not included
        try:
            if counts is None:
                counts = await self._count(ctx.tenant, req.texts)
            tokens = sum(counts)
            t0 = time.perf_counter()
            vectors = await self._vectors(req.texts, ctx.tenant, ready)
            wall_s = time.perf_counter() - t0
            # packed and built before the answer counts as ready: a client that leaves meanwhile is 499
            packed, body = await self._build(ctx.tenant, vectors, tokens, req.encoding_format, pack=keep is not None)
            if packed is not None:
                stored = {"model": self.spec.model, "prompt_tokens": tokens, "count": len(vectors), "vectors": packed}
            status, http_status = "ok", 200
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            err = client_error(exc)
            status, http_status, error_code = "error", err.status_code, err.code
            if err is exc:
                raise
            raise err from exc
        finally:
            if status == "ok":
                used = tokens
            elif status == "cancelled" and counts is not None:  # what ran for it: the texts whose vectors were ready
                used = sum(n for n, r in zip(counts, ready, strict=True) if r)
            else:
                used = 0
            await self._settle(ctx, reservation, used, status, http_status, error_code,
                               (time.perf_counter() - t0 if wall_s is None else wall_s) if used else 0.0,
                               wait=status != "cancelled",
                               keep=keep, stored=stored)
        return body

    async def _build(self, tenant: str, vectors: np.ndarray, tokens: int, encoding_format: str, *,
                     pack: bool) -> tuple[str | None, bytes]:
        """`answer_body` in one of the counting threads, tenants in turn: for 2,048 vectors about 20 ms to pack them
        and 100 ms to build the body, too long for the event loop. Cancelled (the client left), a call not yet begun
        never runs, and one under way ends in its thread, its results unused: the answer is not stored and the claim
        is given up (`embed`'s `finally`)."""
        return await self.counting.run(tenant, functools.partial(answer_body, vectors, model=self.spec.model,
                                                                 prompt_tokens=tokens,
                                                                 encoding_format=encoding_format, pack=pack))

    async def _vectors(self, texts: list[str], tenant: str, ready: list[bool]) -> np.ndarray:
        """[N, 384]: the texts go to the batcher together, in one call (`embed_many`); its batches take turns between
        tenants, so a tenant's 2,048 texts hold up another's one for a batch, not all. `ready[i]` is set as text i's
        vector comes. Cancelled (the client left), the texts still queued are dropped from the batches to come (the
        batcher skips a text whose future is cancelled)."""
        futures = self.batcher.embed_many(texts, owner=tenant)
        for i, future in enumerate(futures):
            future.add_done_callback(functools.partial(_mark_ready, ready, i))
        try:
            rows = await asyncio.gather(*futures)
        finally:
            for future in futures:  # those still queued (the client left, or another text's pass failed)
                future.cancel()
        return np.stack(rows)  # type: ignore[arg-type]  # `_encode_many` gives every text a vector

    def close(self) -> None:
        self.batcher.close()


def build_embeddings(services: Services) -> EmbeddingsService:
    """The service over the app's own gate, reservations, refusal log, ledger and ladder, and the process's
    MiniLM (the one the semantic cache loads)."""
    pipeline, settings = services.pipeline, services.settings
    return EmbeddingsService(spec=services.catalogue.embeddings, embedder=default_embedder(), gate=pipeline.gate,
                             reserve=pipeline.reserve, refusals=pipeline.refusals, ledger=services.ledger,
                             quotas=pipeline.reserve.quotas, metrics=services.metrics, ladder=services.ladder,
                             max_batch=settings.cache_embed_max_batch,
                             max_wait_s=settings.cache_embed_max_wait_ms / 1000,
                             counting=pipeline.prompt.threads, idempotency=pipeline.idempotency)


def provide_embeddings(state: State) -> EmbeddingsService:
    """The app's service, built on first use (requests that never embed never load anything for it)."""
    service = state.get("embeddings")
    if service is None:
        service = state.embeddings = build_embeddings(state.services)
    return service


@asynccontextmanager
async def embeddings_lifespan(app: Litestar) -> AsyncIterator[None]:
    """Listed after the app's main lifespan, so it ends first: settlements reach the ledger before it closes."""
    try:
        yield
    finally:
        service = app.state.get("embeddings")
        if service is not None:
            await service.drain()
            service.close()
