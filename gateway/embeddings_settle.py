"""The settlement of an embeddings request (gateway/embeddings_service.py): its one ledger row (with its answer
for its Idempotency-Key, where the store commits it with the row), its quota settled to what it used, and its answer
kept under its key once the row is durable; written and settled exactly once, in the `finally` of the service's
`_answer`, whatever ends the request. What must not be lost with the request's task is handed off (`_hand_off`,
gateway/pipeline/handed_off.py) and drained at shutdown (`drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from decimal import Decimal
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.pipeline.context import RequestContext
from gateway.pipeline.handed_off import HandedOff
from gateway.pipeline.idempotency import IdempotencyStage, Keep, keep_when_written
from gateway.pipeline.settle import answered_instead
from quotas.ledger import Ledger, LedgerRow, Statement
from quotas.ledger_withdrawals import withdrawn
from quotas.reservations import QuotaService, Reservation
from tiers.catalogue import EmbeddingSpec

TIER = "embeddings"  # the ledger's `tier` for these rows

log = logging.getLogger("tiergate.embeddings")


class EmbeddingsSettlement:
    """The settling half of `EmbeddingsService`, its base: the service's constructor sets what it reads."""

    spec: EmbeddingSpec
    ledger: Ledger
    quotas: QuotaService
    metrics: GatewayMetrics
    idempotency: IdempotencyStage | None
    _handed: HandedOff

    async def _settle(self, ctx: RequestContext, reservation: Reservation, tokens: int, status: str,
                      http_status: int, error_code: str | None, wall_s: float, *, wait: bool,
                      keep: Keep | None = None, stored: dict[str, Any] | None = None) -> None:
        """The request's ledger row (with its answer for its Idempotency-Key, where the store commits it with the
        row), then its quota settled to what it used; durable before return if `wait` (a cancelled request must not
        await: its writes are handed off). Everything that holds money or a key is queued or handed off before the
        first await, or as the await is cancelled, so a cancel during the wait loses none of it.

        A row not durable within the ledger's wait is withdrawn, as a JSON chat answer's is (gateway/pipeline/
        settle.py says why): still queued, it never commits, and the client's 503 spends nothing (the quota's
        reservation given back, the key's answer not kept, so a retry runs once); its commit under way, the request
        waits for that commit and is answered as it decides. The metrics count the request as its client got it, once
        the wait is over: the 503 of a row withdrawn or refused (status `error`), never the answer it did not get.

        Once the row is durable, a quota settle that fails is never the client's error (as gateway/pipeline/settle.py's
        `_settle_ended`): the hand-off logs it, the store's settle is retried (`QuotaService.settle`) and the reaper
        bills what is left from the row; a 5xx for an answer billed sends a client, or the OpenAI SDK, to pay twice."""
        price = self.spec.price(tokens)
        row = LedgerRow(
            request_id=ctx.request_id, ts=ctx.arrived, tenant=ctx.tenant, key_id=ctx.key_id, tier=TIER,
            model=self.spec.model, status=status, http_status=http_status, input_tokens=tokens, output_tokens=0,
            price_usd=price, compute_cost_usd=self.spec.compute_cost(wall_s), cost_basis="wall" if wall_s else "none",
            ttft_s=None, total_s=time.perf_counter() - ctx.t0, error_code=error_code, route_reason="embeddings",
            fallback=reservation.decision.fallback)
        with_row: tuple[Statement, ...] = ()
        if stored is not None and keep is not None and self.idempotency is not None:
            try:
                with_row = self.idempotency.store.finish_with_row(keep.claim, stored, ctx.plan.idempotency_ttl_s)
            except Exception:  # the row is written and the quota settled all the same; the answer is answered, not
                # kept (as one over the store's bound): its claim is given up by `embed`, and a retry runs again
                log.exception("Idempotency-Key %r: the answer cannot be stored; a retry runs again", keep.claim.key)
                stored = None
        written = self.ledger.submit(row, with_row=with_row)
        kept = None
        if stored is not None and keep is not None and self.idempotency is not None:
            # the claim is the answer's now, never given up (a retry must replay it, not run and be billed again)
            keep.kept_with(written)
            kept = self._hand_off(self._keep(written, keep, stored, ctx.plan.idempotency_ttl_s))
        with contextlib.suppress(Exception):  # metrics are not worth a lost settlement; the bill once it is durable
            self.metrics.billed_when_written(row, written)
        if not wait:
            self._counted(row)
            self._hand_off(self._settle_quota(written, reservation, tokens, row))
            return
        try:
            await self.ledger.wait_durable(written, withdraw=True)  # a JSON answer: its client gets only the error
        except asyncio.CancelledError:  # left while the row was being written: settled once it is, handed off
            self._counted(row)
            self._hand_off(self._settle_quota(written, reservation, tokens, row))
            raise
        except Exception as exc:  # withdrawn (nothing spent) or refused: settled as its fate says
            self._counted(answered_instead(row, exc, ctx.t0))  # the client gets the error instead of the answer
            self._hand_off(self._settle_quota(written, reservation, tokens, row, waited=True))
            raise
        self._counted(row)
        with contextlib.suppress(Exception):  # the row is durable, the answer billed: a failure is logged only
            await asyncio.shield(self._hand_off(self._settle_quota(written, reservation, tokens, row, waited=True)))
        if kept is not None:  # stored (in Redis too) before the client reads the answer; its failure is logged
            with contextlib.suppress(Exception):
                await asyncio.shield(kept)

    def _counted(self, told: LedgerRow) -> None:
        """The request in the metrics as its client got it (its bill is counted once its row is durable): once its
        row's wait is over, for the answer may be withheld then (`answered_instead`: its client gets the 503)."""
        with contextlib.suppress(Exception):  # metrics are not worth a lost settlement
            self.metrics.finished(told, None, billed=False)

    async def _settle_quota(self, written: asyncio.Future[None], reservation: Reservation, tokens: int,
                            row: LedgerRow, *, waited: bool = False) -> None:
        """The quota settled once the row is durable, or its wait is over (`waited`: the request's was); given back,
        at nothing, where the row was withdrawn."""
        if not waited:
            with contextlib.suppress(Exception):  # the row's fate is the caller's; the quota settles anyway
                await self.ledger.wait_durable(written)  # a row whose withdrawal is pending: until its commit decides
        if withdrawn(written):
            await self.quotas.settle(reservation, tokens=0, price=Decimal(0))
        else:
            await self.quotas.settle(reservation, tokens=tokens, price=row.price_usd, row=written)

    async def _keep(self, written: asyncio.Future[None], keep: Keep, stored: dict[str, Any], ttl_s: float) -> None:
        """Store the answer once its row is durable (a store that commits it with the row has done so: its `finish`
        does nothing); a row refused for good takes its answer with it, and the claim is given up. The row's final
        outcome, not the request's wait for it: a row late past that wait still commits, billed, and a retry must
        replay its answer, not run again (gateway/pipeline/idempotency.py's `keep_when_written`)."""
        assert self.idempotency is not None
        await keep_when_written(self.idempotency.store, written, keep, stored, ttl_s)

    def _hand_off(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run `work` to its end even if the request is cancelled; its failure is logged."""
        return self._handed.run(work)

    async def drain(self) -> None:
        """Wait for handed-off settlements (shutdown, tests)."""
        await self._handed.drain()
