"""POST /v1/embeddings behind the same admission as chat: gate → parse → degrade → count → reserve → embed →
ledger row → settle.

It reuses the chat pipeline's parts directly (the gate, `ReserveStage`, `RefusalLog`, the ledger, the quota
service) rather than the pipeline itself, whose route, cache, dispatch and settle stages are about a tier's
stream. What differs from chat:

- The model is the semantic cache's MiniLM (`cache.default_embedder()`: one model per process), run in the
  gateway. Its forward passes go through an `EmbeddingBatcher` of their own, so concurrent requests' texts
  share passes, and a large embeddings request never waits in line with (or holds up) the cache's lookups.
- Tokens are MiniLM's word pieces, the two special tokens included, up to the `max_tokens` the model reads:
  what it ran on. They are counted before the reservation (in a worker thread; the wire model bounds the
  texts), so the reservation is exact and settles to the same count, or to nothing if no vector was returned.
- Price: the catalogue's `embeddings.price_per_1k_input` (tiers/catalogue.py says why it lives there). Compute
  cost: the catalogue's hardware rate over the wall time of the request's forward passes (`cost_basis`
  "wall", as for a remote tier that reports no busy time).
- One ledger row per admitted request, with `tier` "embeddings" and `model` the model's name; refusals before
  the reservation are counted as chat's are. A client that leaves is billed nothing (no vector was sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from litestar import Litestar
from litestar.datastructures import State

from cache.batcher import EmbeddingBatcher
from cache.embedder import Embedder, default_embedder
from gateway.errors import InvalidRequest, NotFound, Unavailable, client_error
from gateway.fair_threads import FairThreads
from gateway.ladder.apply import Degradation
from gateway.ladder.controller import LadderController
from gateway.metrics import GatewayMetrics
from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import TenantGate, refused_size, scopes_of
from gateway.pipeline.refusals import RefusalLog
from gateway.pipeline.reserve import ReserveStage, ratelimit_headers
from gateway.services import Services
from gateway.validation import parse_body
from quotas.ledger import Ledger, LedgerRow
from quotas.reservations import QuotaService, Reservation
from tiers.catalogue import EmbeddingSpec
from wire.embeddings import EmbeddingRequest, embedding_list

TIER = "embeddings"  # the ledger's `tier` for these rows


class EmbeddingsService:
    def __init__(self, *, spec: EmbeddingSpec, embedder: Embedder, gate: TenantGate, reserve: ReserveStage,
                 refusals: RefusalLog, ledger: Ledger, quotas: QuotaService, metrics: GatewayMetrics,
                 ladder: LadderController | None, counting: FairThreads, max_batch: int = 32,
                 max_wait_s: float = 0.003) -> None:
        self.spec = spec
        self.counting = counting  # where texts are counted, tenants in turn (the prompt stage's threads)
        self.embedder = embedder
        self.gate = gate
        self.reserve = reserve
        self.refusals = refusals
        self.ledger = ledger
        self.quotas = quotas
        self.metrics = metrics
        self.ladder = ladder
        self.batcher = EmbeddingBatcher(self._encode_many, max_batch=max_batch, max_wait_s=max_wait_s)
        self._background: set[asyncio.Task[None]] = set()

    async def embed(self, ctx: RequestContext, body: bytes) -> tuple[dict[str, Any], dict[str, str]]:
        """The answer to one embeddings request and its headers (OpenAI's `x-ratelimit-*`); raises a
        `TiergateError` (counted as a refusal before the reservation, written to the ledger after it)."""
        with self.refusals.counted(ctx):
            entry = self.gate.enter(scopes_of(ctx.tenant, ctx.key_id, ctx.plan.limits, ctx.principal.key.limits))
        try:
            with self.refusals.counted(ctx):
                req, tokens = await self._admit(ctx, body)
                reservation = await self.reserve.reserve(ctx, ctx.request_id, tokens=tokens,
                                                         price=self.spec.price(tokens))
            answer = await self._answer(ctx, req, tokens, reservation)
            return answer, ratelimit_headers(ctx.plan, reservation.decision)
        finally:
            entry.leave()

    async def _admit(self, ctx: RequestContext, body: bytes) -> tuple[EmbeddingRequest, int]:
        """Every check, cheapest first: readiness, the body, the model, the ladder; then the token count."""
        if (why := self.ledger.not_ready_reason) is not None:
            raise Unavailable(f"the gateway cannot take requests now: {why}", code="not_ready", retry_after=5)
        try:
            req = parse_body(body, EmbeddingRequest)
        except InvalidRequest:  # its parse cost the event loop and charges nothing: the gate counts it, as for chat,
            self.gate.body_refused(ctx.tenant, refused_size(body, ctx.headers))  # headers and all
            raise
        if not self.spec.enabled or req.model != self.spec.model:
            served = f"; this gateway serves {self.spec.model!r}" if self.spec.enabled else ""
            raise NotFound(f"no embedding model {req.model!r}{served}", param="model", code="model_not_found")
        self._refuse_if_degraded(ctx)
        return req, await self.counting.run(ctx.tenant, self._num_tokens, req.texts)

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

    def _num_tokens(self, texts: list[str]) -> int:
        """Word pieces the model reads of each text (special tokens included), summed."""
        limit = self.embedder.max_tokens
        return sum(min(limit, self.embedder.num_tokens(t)) for t in texts)

    def _encode_many(self, texts: list[str]) -> list[np.ndarray | None]:
        return list(self.embedder.encode(texts))

    async def _answer(self, ctx: RequestContext, req: EmbeddingRequest, tokens: int,
                      reservation: Reservation) -> dict[str, Any]:
        status, http_status, error_code, wall_s = "cancelled", 499, None, 0.0
        try:
            t0 = time.perf_counter()
            vectors = await self._vectors(req.texts, ctx.tenant)
            wall_s = time.perf_counter() - t0
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
            await self._settle(ctx, reservation, tokens if status == "ok" else 0, status, http_status, error_code,
                               wall_s, wait=status != "cancelled")
        return embedding_list(vectors, model=self.spec.model, prompt_tokens=tokens,
                              encoding_format=req.encoding_format)

    async def _vectors(self, texts: list[str], tenant: str) -> np.ndarray:
        """[N, 384]: the texts go to the batcher together (announced first, so their pass waits for all); its
        batches take turns between tenants, so a tenant's 2,048 texts hold up another's one for a batch, not all."""
        announced = [self.batcher.announce() for _ in texts]
        try:
            rows = await asyncio.gather(*(self.batcher.embed(t, a, owner=tenant)
                                          for t, a in zip(texts, announced, strict=True)))
        finally:
            for announcement in announced:
                announcement.close()
        return np.stack(rows)  # type: ignore[arg-type]  # `_encode_many` gives every text a vector

    async def _settle(self, ctx: RequestContext, reservation: Reservation, tokens: int, status: str,
                      http_status: int, error_code: str | None, wall_s: float, *, wait: bool) -> None:
        """The request's ledger row, then its quota settled to what it used; durable before return if `wait`
        (a cancelled request must not await: its writes are handed off)."""
        price = self.spec.price(tokens)
        row = LedgerRow(
            request_id=ctx.request_id, ts=ctx.arrived, tenant=ctx.tenant, key_id=ctx.key_id, tier=TIER,
            model=self.spec.model, status=status, http_status=http_status, input_tokens=tokens, output_tokens=0,
            price_usd=price, compute_cost_usd=self.spec.compute_cost(wall_s), cost_basis="wall" if wall_s else "none",
            ttft_s=None, total_s=time.perf_counter() - ctx.t0, error_code=error_code, route_reason="embeddings")
        written = self.ledger.submit(row)
        settled = asyncio.get_running_loop().create_task(self._settle_quota(written, reservation, tokens, row))
        self._background.add(settled)
        settled.add_done_callback(self._background.discard)
        with contextlib.suppress(Exception):  # metrics are not worth a lost settlement
            self.metrics.finished(row, None)
        if wait:
            await self.ledger.wait_durable(written)
            await asyncio.shield(settled)

    async def _settle_quota(self, written: asyncio.Future[None], reservation: Reservation, tokens: int,
                            row: LedgerRow) -> None:
        with contextlib.suppress(Exception):  # the row's fate is the caller's; the quota settles anyway
            await self.ledger.wait_durable(written)
        await self.quotas.settle(reservation, tokens=tokens, price=row.price_usd)

    async def drain(self) -> None:
        """Wait for handed-off settlements (shutdown, tests)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

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
                             counting=pipeline.prompt.threads)


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
