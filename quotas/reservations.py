"""Quota reservations: turn a plan (and a key's overrides) into scope limits, reserve, settle."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any

from quotas.backends.base import QuotaBackend, QuotaBackendError
from quotas.backends.journal import FallbackRow, fallback_row
from quotas.backends.settle_backoff import SETTLE_BACKOFF_S, retry
from quotas.fault_log import FaultLog
from quotas.limits import Decision, ReservationRequest, ScopeLimits
from quotas.money import to_pico
from quotas.plans import Limits, Plan

log = logging.getLogger("tiergate.quotas")


def scope_limits(scope: str, limits: Limits) -> ScopeLimits:
    return _scope_limits(scope, limits.rpm, limits.tpm, limits.max_concurrent, limits.budget_day_usd,
                         limits.budget_month_usd)


@lru_cache(maxsize=4096)
def _scope_limits(scope: str, rpm: int | None, tpm: int | None, max_concurrent: int | None,
                  budget_day_usd: Decimal | None, budget_month_usd: Decimal | None) -> ScopeLimits:
    """A scope's limits from their values (frozen, so shared): every request of a plan reserves the same ones, and
    building them (two money conversions, a dataclass) cost ~4 us a request."""
    return ScopeLimits(
        scope=scope, rpm=rpm, tpm=tpm, max_concurrent=max_concurrent,
        budget_day_pico=None if budget_day_usd is None else to_pico(budget_day_usd),
        budget_month_pico=None if budget_month_usd is None else to_pico(budget_month_usd))


# a price in picodollars, remembered: a reserve and a settle convert one each (~1 us of Decimal arithmetic), and the
# prices repeat (a plan's cache-hit price, a tier's price of the same prompt length); equal prices, one result
_pico = lru_cache(maxsize=1024)(to_pico)


@dataclass
class Reservation:
    """A granted reservation of requests, tokens, money and a concurrency slot, to be settled exactly once; its slot
    freed by its settle, or, where it is kept (`QuotaService.keep_slot`), by `QuotaService.release_slot`, once."""

    request: ReservationRequest
    decision: Decision
    settled: bool = False
    slot_kept: bool = False  # its slot outlives its settle: freed by `release_slot`, not by the settle
    # `release_slot` has freed it (or is freeing it, in the background), or a follow-on took it over in the store
    # (`QuotaService._taken_over`)
    slot_released: bool = False


class QuotaService:
    def __init__(self, backend: QuotaBackend, *, lease_s: float = 900.0,
                 on_settled: Callable[[str, tuple[str, ...]], None] | None = None) -> None:
        """`on_settled(tenant, scopes)` is told of each settlement here (scopes: "t", "k:<key id>"): what a
        reservation held beyond its use is free again (the gate forgets the refusals it may have caused)."""
        self.backend = backend
        self.lease_s = lease_s  # a reservation not settled within this is returned by the reaper
        self.on_settled = on_settled
        # the reservations not yet settled, each while its request holds it: `renew_leases` pushes their leases ahead,
        # so a request that runs longer than its lease (a long stream) keeps its money reserved and its slot; one whose
        # request ended without settling it (a bug) drops out, and the reaper returns it when its lease runs out
        self._open: weakref.WeakValueDictionary[str, Reservation] = weakref.WeakValueDictionary()
        # the reservations whose slot is kept past their settle (`keep_slot`), until it is released: renewed with the
        # open ones, so a slot held while a long answer is handed over is not taken for a dead replica's
        self._kept: weakref.WeakValueDictionary[str, Reservation] = weakref.WeakValueDictionary()
        # settles and releases the backend raised on, retried in the background (`_settle_later`, `release_slot`):
        # held so they are not collected
        self._retrying: set[asyncio.Task[None]] = set()
        self._settle_faults = FaultLog(log, "settling reservations (retried in the background)", rounds="settles")
        self._release_faults = FaultLog(log, "freeing concurrency slots (retried in the background)",
                                        rounds="releases")

    @staticmethod
    def scopes(plan: Plan, key_id: str, key_limits: Limits | None) -> tuple[ScopeLimits, ...]:
        """The tenant's scope (plan limits) and, where the key has its own limits, the key's scope."""
        out = [scope_limits("t", plan.limits)]
        if key_limits is not None:
            key_scope = scope_limits(f"k:{key_id}", key_limits)
            if not key_scope.is_empty():
                out.append(key_scope)
        return tuple(out)

    async def reserve(self, *, request_id: str, tenant: str, plan: Plan, key_id: str, key_limits: Limits | None,
                      tokens: int, price: Decimal, dated_at: float | None = None, follows: str | None = None
                      ) -> tuple[Decision, Reservation | None]:
        """`dated_at`: the instant whose day and month its money counts for, reserve and settle alike: the
        request's arrival, which also dates its ledger row; the backend bounds it by its own clock (see
        `ReservationRequest.dated_at`). `follows`: the reserved attempt of the same client request this one
        continues (a cascade's retry, the exact reservation after a floor), whose rpm place and concurrency slot it
        keeps (`ReservationRequest.follows`): admitted, it has that attempt's kept slot, whose release is then done
        here, with no call to the store (`_taken_over`); refused, that attempt keeps its slot, for its release."""
        req = ReservationRequest(request_id, tenant, self.scopes(plan, key_id, key_limits), tokens, _pico(price),
                                 lease_s=self.lease_s, dated_at=dated_at, follows=follows)
        decision = await self.backend.reserve(req)
        if not decision.admitted:
            return decision, None
        if follows is not None:
            self._taken_over(follows, req)
        reservation = self._open[request_id] = Reservation(req, decision)
        return decision, reservation

    def _taken_over(self, follows: str, req: ReservationRequest) -> None:
        """`req`, just admitted, follows `follows`: where that reservation's slot is kept and not yet released, the
        store moved it to `req` (it took the slot over in every scope of `req`'s; a slot already free there, its lease
        run out, was a new one), so it is released here, as done: its release would free nothing and still cost a
        round trip to Redis, which the answer's last piece waits on (`release_slot`); not renewed either. Kept for its
        release where the store may not have moved it: a scope of its own that `req` lacks, or a store of two
        (quotas/backends/failover.py `took_over`: one reservation on the fail-open fallback, the other on Redis).
        No await since the store's answer: nothing released it meanwhile."""
        followed = self._kept.get(follows)
        if followed is None or followed.slot_released:
            return
        mine = followed.request
        if mine.tenant != req.tenant or not {s.scope for s in mine.scopes} <= {s.scope for s in req.scopes}:
            return
        if not self.backend.took_over(mine, req):  # (a store of two, where one holds each)
            return
        followed.slot_released = True
        self._kept.pop(follows, None)

    async def renew_leases(self) -> int:
        """Push ahead the leases of the open reservations reserved more than a third of their lease ago (their requests
        still run: a live replica's reservation must not be reaped as a dead one's, its money refunded and its slot
        freed mid-answer); how many were renewed. Each reaper round runs it before reaping (quotas/reaper.py)."""
        cutoff = time.time() - self.lease_s / 3
        due = [r.request for r in list(self._open.values()) if not r.settled and r.request.now <= cutoff]
        due += [r.request for r in list(self._kept.values())
                if r.settled and not r.slot_released and r.request.now <= cutoff]  # (an open one is in `due`)
        if due:
            await self.backend.renew(due)
        return len(due)

    async def budget_left(self, *, tenant: str, plan: Plan, key_id: str, key_limits: Limits | None,
                          now: float) -> float | None:
        """The smallest share (0-1) left of any daily or monthly budget over the tenant and key scopes; None
        when no scope has a budget or the backend cannot tell. One backend read (a round trip on Redis)."""
        scopes = [s for s in self.scopes(plan, key_id, key_limits)
                  if s.budget_day_pico is not None or s.budget_month_pico is not None]
        if not scopes:
            return None
        spent = await self.backend.spent(tenant, [s.scope for s in scopes], now)
        if spent is None:
            return None
        left = 1.0
        for s in scopes:
            day, month = spent.get(s.scope, (0, 0))
            for limit, used in ((s.budget_day_pico, day), (s.budget_month_pico, month)):
                if limit is not None:
                    left = min(left, max(0.0, (limit - used) / limit) if limit else 0.0)
        return left

    async def settle(self, reservation: Reservation, *, tokens: int, price: Decimal,
                     row: asyncio.Future[None] | None = None) -> None:
        """Once per reservation. Returns after one try at the store: the backend retries a failed settle in
        the background (bounded backoff, idempotent), so the caller never waits on an outage. A backend's settle that
        raises all the same (one that retries nothing of its own, or a fault of the backend's) never raises here:
        its ledger row may be durable already, its answer sent and billed; it is retried in the background
        (`_settle_later`), and past that the reaper bills the reservation from its row once its lease ends.

        `row`: its ledger row's future (`Ledger.submit`), where one was written at `price`. A reservation admitted
        with a fallback mark counts on that row to carry its money to the shared counters; if the ledger refuses it,
        now or after the caller stopped waiting, the backend carries the money itself (`row_refused`)."""
        if reservation.settled:
            return
        reservation.settled = True
        self._open.pop(reservation.request.request_id, None)
        self._follow_row(reservation, price, row)
        try:
            await self.backend.settle(reservation.request, tokens=tokens, money_pico=_pico(price),
                                      keep_slot=reservation.slot_kept)
        except Exception as exc:
            self._settle_later(reservation, tokens, _pico(price), exc)
            return
        self._settled(reservation)

    @property
    def settles_at_once(self) -> bool:
        """The backend settles without suspending (the in-process one): `settle_now` may be called instead."""
        return self.backend.settles_at_once()

    def settle_now(self, reservation: Reservation, *, tokens: int, price: Decimal,
                   row: asyncio.Future[None] | None = None) -> None:
        """`settle` with no await, where `settles_at_once`: the same settlement, once per reservation (a failure
        retried in the background as `settle`'s)."""
        if reservation.settled:
            return
        reservation.settled = True
        self._open.pop(reservation.request.request_id, None)
        self._follow_row(reservation, price, row)
        try:
            self.backend.settle_now(reservation.request, tokens=tokens, money_pico=_pico(price),
                                    keep_slot=reservation.slot_kept)
        except Exception as exc:
            self._settle_later(reservation, tokens, _pico(price), exc)
            return
        self._settled(reservation)

    def _settle_later(self, reservation: Reservation, tokens: int, money_pico: int, exc: Exception) -> None:
        """The backend's settle raised (`exc`): logged (once an outage), and sent again in the background with a
        settle's backoff (quotas/backends/settle_backoff.py `retry`; the backend's settle is idempotent) for as long as
        the reservation's lease. Given up after that, the reservation is the reaper's: not renewed (no longer open),
        it is returned when its lease ends, billed what its ledger row says (`QuotaBackend.reap`)."""
        self._settle_faults.failed(exc)
        req, keep_slot = reservation.request, reservation.slot_kept

        async def again() -> None:
            if await retry(lambda: self.backend.settle(req, tokens=tokens, money_pico=money_pico, keep_slot=keep_slot),
                           SETTLE_BACKOFF_S[0], self.lease_s, retried=(Exception,)):
                self._settle_faults.ok()
                self._settled(reservation)
            else:
                self._settle_faults.failed(QuotaBackendError(
                    f"a settle retried for {self.lease_s:g}s is given up: its lease's reaper returns it"))

        self._spawn(again())

    def keep_slot(self, reservation: Reservation) -> bool:
        """Keep `reservation`'s concurrency slot past its settle, until `release_slot`: its request's answer is written
        down and billed before it is sent, and the request counts toward `max_concurrent` until it is handed over to
        its client (gateway/pipeline/gate.py `Pass.keeps`), on every replica sharing the store. Only before its settle,
        and only where a scope has a concurrency limit (else nothing counts the slot, and its release would cost a
        round trip to the store for nothing); whether it is kept now."""
        if reservation.settled or reservation.slot_kept \
                or all(s.max_concurrent is None for s in reservation.request.scopes):
            return False
        reservation.slot_kept = True
        self._kept[reservation.request.request_id] = reservation
        return True

    def release_slot(self, reservation: Reservation) -> asyncio.Future[None] | None:
        """Free a kept slot, once (a second call, or one for a slot not kept, or taken over by a follow-on admitted
        since, does nothing), settled or not: where the store settles at once, now; else handed to a task and retried
        in the background as a settle is (the store's release is idempotent) for as long as the reservation's lease,
        past which the slot's lease frees it. Never raises: the request it ends is answered whatever the store does.

        What it returns, where it handed the release to a task (else None: freed now, or nothing to free): a future
        done once the store has answered its first try (the slot freed; or not, and retried in the background), so
        bounded by the store's own call timeout; never failed. A caller may wait on it (never cancel it) before it
        tells the client its answer is whole (gateway/middleware.py `_send_last`): a client that sends its next
        request at once, through another replica, is not refused for this one."""
        if not reservation.slot_kept or reservation.slot_released:
            return None
        reservation.slot_released = True
        self._kept.pop(reservation.request.request_id, None)
        req = reservation.request
        if self.backend.settles_at_once():
            try:
                self.backend.release_now(req)
            except Exception as exc:  # (a bug of an in-process store's): tried again as a remote store's release is
                self._release_faults.failed(exc)
            else:
                return None
        tried: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def release() -> None:
            try:
                await self.backend.release(req)
            except Exception as exc:
                self._release_faults.failed(exc)
            else:
                self._release_faults.ok()
                return
            finally:  # (cancelled too: at shutdown)
                if not tried.done():
                    tried.set_result(None)
            if await retry(lambda: self.backend.release(req), SETTLE_BACKOFF_S[0], self.lease_s,
                           retried=(Exception,)):
                self._release_faults.ok()
            else:
                self._release_faults.failed(QuotaBackendError(
                    f"a slot's release retried for {self.lease_s:g}s is given up: its lease frees it"))

        self._spawn(release())
        return tried

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._retrying.add(task)
        task.add_done_callback(self._retrying.discard)

    def _follow_row(self, reservation: Reservation, price: Decimal, row: asyncio.Future[None] | None) -> None:
        req, mark = reservation.request, reservation.decision.fallback
        if row is not None and mark is not None:
            refused = fallback_row(req.request_id, req.tenant, to_pico(price), mark)
            row.add_done_callback(lambda written: self._row_ended(written, refused))

    def _settled(self, reservation: Reservation) -> None:
        if self.on_settled is not None:
            req = reservation.request
            self.on_settled(req.tenant, tuple(s.scope for s in req.scopes))

    def _row_ended(self, written: asyncio.Future[None], row: FallbackRow) -> None:
        if not written.cancelled() and written.exception() is not None:
            self.backend.row_refused(row)
