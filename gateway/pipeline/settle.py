"""Settle: the one place an attempt's end is written down. Exactly once per attempt, from a `finally`.

It prices what ran, writes the durable ledger row (price, compute cost, cache and routing savings, degrade
level), settles the quota reservation to real use, frees the dispatch slot, feeds the ladder's signals and
the metrics, and hands a fresh answer to the cache. A cancelled attempt (the client left) must not await:
its writes are handed off, the row still queued synchronously for the next group commit. The quota's settle leaves
the reservation's concurrency slot held where it is kept until the answer is handed over to the client
(reserve.py `_keep_slot`): the row and the money are settled here, before the answer is sent, as ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from decimal import Decimal
from typing import Any

from gateway.errors import client_error
from gateway.ladder.signals import Signals
from gateway.metrics import GatewayMetrics
from gateway.pipeline.attempt import Attempt
from gateway.pipeline.cache_lookup import CacheStage
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import DispatchStage
from gateway.pipeline.handed_off import HandedOff
from gateway.pipeline.meter import Outcome
from gateway.rollout.service import RolloutService
from quotas.dispatch import Ticket
from quotas.ledger import Ledger, LedgerRow, Statement
from quotas.ledger_withdrawals import withdrawn
from quotas.reservations import QuotaService
from tiers.catalogue import TierCatalogue

log = logging.getLogger("tiergate.settle")
ZERO = Decimal(0)  # (one, shared: immutable; a row built three at every request)


class Settler:
    def __init__(self, *, ledger: Ledger, quotas: QuotaService, dispatch: DispatchStage, cache: CacheStage,
                 metrics: GatewayMetrics, signals: Signals, catalogue: TierCatalogue,
                 rollouts: RolloutService | None = None) -> None:
        self.ledger = ledger
        self.quotas = quotas
        self.dispatch = dispatch
        self.cache = cache
        self.metrics = metrics
        self.signals = signals
        self.catalogue = catalogue
        self.rollouts = rollouts  # counts each version's requests and errors during a rollout
        # settles and kept answers whose request may leave before they end
        self._handed = HandedOff(log, "work handed off by a request failed")

    async def settle(self, ctx: RequestContext, attempt: Attempt, outcome: Outcome, ticket: Ticket | None, *,
                     wait: bool, with_row: tuple[Statement, ...] = (),
                     on_queued: Callable[[asyncio.Future[None]], object] | None = None,
                     withdraw: bool = False) -> LedgerRow:
        """Write the attempt's row and release what it held; durable before return unless `wait` is False.
        `on_queued` is given the row's future (the ledger's) as soon as it is queued, before any await: what
        depends on the row's final outcome, not on this wait for it (an Idempotency-Key's claim), follows it.

        What holds money or capacity comes first and cannot be skipped by a failure after it: the row is
        queued, the slot freed and the quota settled whatever the metrics or the cache do. The quota is
        settled once the row's fate is known: a gateway killed in between leaves a reservation that the quota
        reaper bills from the ledger row, never a settled quota without its row. A quota settle that fails is
        never the client's error (`_settle_ended`): it is retried, and the row is what the client is billed.

        A row not durable within the ledger's wait raises `LedgerUnavailable` (a 503). What the client was told
        and what it is billed then agree:
        - `withdraw` (a JSON answer: the client gets the error instead of the answer): the row still queued is
          withdrawn (quotas/ledger.py `wait_durable`), the 503 spends nothing: no row ever commits, the quota's
          reservation is given back (settled at nothing, not at the answer's price), and an Idempotency-Key's
          answer, committed with the row or kept once it commits, is not kept, so its claim is given up and a retry
          runs (and is billed) once. A row whose commit is under way is that commit's: the request waits for it
          (for a commit in doubt, until the writer knows), and returns, answered and billed, if it committed, or
          raises `RowWithdrawn`, nothing spent, if it did not. Withdrawing a row in flight could not be done
          (its commit may land), and telling the client 503 while it may land is the bill contradicting the answer.
        - not `withdraw` (a stream, whose client has the tokens already): the row stays queued and commits once
          the ledger can, billed for what the client received; the quota settles at its price now.
        The metrics' bill (tokens, price, compute cost, savings) follows the row too: counted once it is durable
        (right after the wait; by its future's callback where the wait ended otherwise), never for a row withdrawn
        or refused. The request's count and latencies, the ladder's signal and the cache's store follow what the
        client got: at once where that is known already (a stream, whose tokens are sent; a request not waiting);
        after the wait for a JSON answer (`withdraw`), whose client gets the answer only if its row is durable in
        time, and the 503 instead otherwise, counted as that error (`answered_instead`) and never kept in the cache.
        """
        row = self.row(ctx, attempt, outcome)
        written = self.ledger.submit(row, with_row=with_row)
        if on_queued is not None:
            on_queued(written)
        if ticket is not None:
            self.dispatch.release(attempt.route.tier.name, ticket, outcome.input_tokens + outcome.output_tokens)
        used = 0 if attempt.is_cache_hit else outcome.input_tokens + outcome.output_tokens  # a hit runs no model
        after_wait = wait and withdraw  # what the client gets waits for the row: its answer, or the error instead
        if not after_wait:
            self._observe(attempt, outcome, row)
        if not wait:
            self.hand_off(self._settle_quota(written, attempt, used, row.price_usd))
            self._bill_when_written(row, written)
            return row
        try:
            await self.ledger.wait_durable(written, withdraw=withdraw)
        except asyncio.CancelledError:  # left while the row was being written: settled once it is, handed off
            if after_wait:  # its client left during the wait: counted as the attempt ended (its row commits, billed)
                self._observe(attempt, outcome, row)
            self.hand_off(self._settle_quota(written, attempt, used, row.price_usd))
            self._bill_when_written(row, written)
            raise
        except Exception as exc:  # not durable in time (withdrawn or not), or refused: settled as its fate says
            if after_wait:  # its client gets the error instead of the answer: counted as that, never cached
                self._observe(attempt, outcome, row, instead=answered_instead(row, exc, ctx.t0))
            self._settle_ended(written, attempt, used, row.price_usd)
            self._bill_when_written(row, written)
            raise
        if after_wait:
            self._observe(attempt, outcome, row)
        try:  # durable: its bill in the metrics, now (no callback on the path every answer takes)
            self.metrics.billed(row)
        except Exception:
            log.exception("counting the bill of request %s failed", row.request_id)
        if (settled := self._settle_ended(written, attempt, used, row.price_usd)) is not None:
            with contextlib.suppress(Exception):  # the row is durable, the answer billed: a failure is logged only
                await asyncio.shield(settled)
        return row

    def _settle_ended(self, written: asyncio.Future[None], attempt: Attempt, tokens: int,
                      price: Decimal) -> asyncio.Future[None] | None:
        """The quota settled where the request's wait for its row is over: at once where the quota store settles
        without an await (no task and no shield of its own, ~8 us), else handed off (its future returned).

        Never raises, and the caller ignores its future's failure (the hand-off logs it): the row's fate is what the
        client is told (a row durable is an answer billed; a 5xx for it sends a client, or the OpenAI SDK, to retry
        and pay twice), and the quota follows the row whatever its store does: a store's settle that failed is
        retried in the background (`QuotaService.settle`), and what is left the reaper bills from the row once the
        reservation's lease ends."""
        if not self.quotas.settles_at_once:
            return self.hand_off(self._settle_quota(written, attempt, tokens, price, waited=True))
        tokens, price, row = _terms(written, tokens, price)
        try:
            self.quotas.settle_now(attempt.reservation, tokens=tokens, price=price, row=row)
        except Exception as exc:  # as a handed-off settle's failure is: logged
            log.error("work handed off by a request failed: %s", exc)
        return None

    async def _settle_quota(self, written: asyncio.Future[None], attempt: Attempt, tokens: int,
                            price: Decimal, *, waited: bool = False) -> None:
        """The quota settled once the row is durable, or its wait is over (`waited`: the request's was)."""
        if not waited:
            with contextlib.suppress(Exception):  # the row's own fate is the caller's; the quota settles anyway
                await self.ledger.wait_durable(written)  # a row whose withdrawal is pending: until its commit decides
        tokens, price, row = _terms(written, tokens, price)
        await self.quotas.settle(attempt.reservation, tokens=tokens, price=price, row=row)

    def _observe(self, attempt: Attempt, outcome: Outcome, row: LedgerRow, *,
                 instead: LedgerRow | None = None) -> None:
        """The attempt's end in the metrics, the ladder's signals, a rollout's counts and the cache; never raises (none
        of them is worth a lost settlement). `instead`: what the client got instead of the answer `row` holds (the
        error of a row not durable in time: `answered_instead`), which the metrics and the ladder count, and the
        cache never keeps."""
        try:
            self._observe_now(attempt, outcome, row, instead)
        except Exception:
            log.exception("observing request %s failed", row.request_id)

    def _observe_now(self, attempt: Attempt, outcome: Outcome, row: LedgerRow, instead: LedgerRow | None) -> None:
        told = instead or row  # what the client got
        if outcome.status == "ok" and instead is None and not attempt.is_cache_hit:
            self.cache.save(attempt.lookup, outcome, attempt.applied)
        self.signals.outcome(told.http_status, row.tenant or "")  # one tenant's 5xx do not move the ladder
        version = attempt.route.tier.version_name
        if self.rollouts is not None and version is not None and not attempt.is_cache_hit \
                and outcome.status != "cancelled":  # a server error is the version's; a 4xx is the request's
            # the version's own result: an answer it gave whole, withheld for the ledger's fault, is not its error
            failed = outcome.status == "error" and outcome.http_status >= 500
            self.rollouts.observe(row.tier or "", version, error=failed, ttft_s=row.ttft_s, tpot_s=tpot(row),
                                  tenant=row.tenant, prompt_tokens=row.input_tokens)  # no one tenant decides
        overhead = told.total_s - outcome.upstream_s if outcome.upstream_s is not None else None
        self.metrics.finished(told, overhead, billed=False)  # its bill is counted once its row is durable (`settle`)
        if row.cache_status is not None:
            self.metrics.child(self.metrics.cache, row.tenant, row.cache_status).inc()

    def _bill_when_written(self, row: LedgerRow, written: asyncio.Future[None]) -> None:
        """The row's bill in the metrics once the ledger says it is durable: never for a row withdrawn or refused,
        which the ledger does not hold (a JSON answer's row late past the wait: its client got a 503)."""
        try:
            self.metrics.billed_when_written(row, written)
        except Exception:
            log.exception("counting the bill of request %s failed", row.request_id)

    def row(self, ctx: RequestContext, attempt: Attempt, outcome: Outcome) -> LedgerRow:
        tier = attempt.route.tier
        price = tier.price(outcome.input_tokens, outcome.output_tokens)
        cache_saving = ZERO
        if attempt.hit_price is not None:  # no model ran: the plan's hit price, and what the tier would have charged
            cache_saving = max(ZERO, price - attempt.hit_price)
            price = attempt.hit_price
            compute, basis = ZERO, "cache"
        elif outcome.upstream_s is None:
            compute, basis = ZERO, "none"
        elif outcome.busy_s is not None:
            compute, basis = tier.compute_cost(outcome.busy_s), "engine"
        else:
            compute, basis = tier.compute_cost(outcome.upstream_s), "wall"
        requested = attempt.route.requested_tier
        route_saving = ZERO
        if requested in self.catalogue.tiers and requested != tier.name and not attempt.is_cache_hit:
            dearer = self.catalogue.tiers[requested].price(outcome.input_tokens, outcome.output_tokens)
            route_saving = max(ZERO, dearer - price)
        reason = "; ".join((attempt.route.reason, *attempt.extra_reason))
        # `ts` is the arrival, the instant that dated the reservation's money (reserve.py; unless the quota store's
        # clock was more than MAX_DATING_LAG_S past it): the settle adjusts that day's counter, whenever it runs
        return LedgerRow(
            request_id=attempt.request_id, ts=ctx.arrived, tenant=ctx.tenant, key_id=ctx.key_id, tier=tier.name,
            model=tier.model, status=outcome.status, http_status=outcome.http_status,
            input_tokens=outcome.input_tokens, output_tokens=outcome.output_tokens, price_usd=price,
            compute_cost_usd=compute, cost_basis=basis, ttft_s=outcome.ttft_s, total_s=time.perf_counter() - ctx.t0,
            finish_reason=outcome.finish_reason, error_code=outcome.error_code, route_reason=reason,
            degrade_level=attempt.route.degradation.level, degrade_actions=",".join(attempt.applied) or None,
            requested_tier=requested, route_saving_usd=route_saving, cache_status=attempt.lookup.status,
            cache_saving_usd=cache_saving, cascade_of=attempt.cascade_of, model_version=tier.version_name,
            fallback=attempt.reservation.decision.fallback)

    def hand_off(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run `work` to its end even if the caller is cancelled; its failure is logged (the backend's
        own failover decides what a failed settle means)."""
        return self._handed.run(work)

    async def drain(self) -> None:
        """Wait for handed-off settlements (shutdown, tests)."""
        await self._handed.drain()


def _terms(written: asyncio.Future[None], tokens: int, price: Decimal
           ) -> tuple[int, Decimal, asyncio.Future[None] | None]:
    """What the quota settles to: the row's use and price, followed by its row; nothing for a row withdrawn (its
    reservation given back, and no row for a fallback reservation's money to follow)."""
    return (0, ZERO, None) if withdrawn(written) else (tokens, price, written)


def answered_instead(row: LedgerRow, exc: BaseException, t0: float) -> LedgerRow:
    """What a JSON answer's client got when its row was not durable in time (`exc`, from the ledger's wait): the error
    (a 503 `ledger_unavailable`) instead of the answer, at the end of that wait, with no output (as `Meter.outcome`
    counts an error a JSON client got instead of its answer). For the metrics and the ladder, never for the ledger."""
    err = client_error(exc)
    return replace(row, status="error", http_status=err.status_code, error_code=err.code, output_tokens=0,
                   total_s=time.perf_counter() - t0)


def tpot(row: LedgerRow) -> float | None:
    """Time per output token after the first (what the metrics' TPOT histogram observes)."""
    if row.ttft_s is None or row.output_tokens < 2:
        return None
    return (row.total_s - row.ttft_s) / (row.output_tokens - 1)
