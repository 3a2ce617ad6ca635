"""In-process quota state for a single gateway (the embedded default), exact under asyncio.

Reservations and settlements run on the event loop without awaiting in between, so each is atomic.
Budgets survive restarts because the gateway seeds them from the durable ledger at start-up (`seed`).

Each open reservation is held with its own amounts and lease (`_Held`), so a settle replaces exactly what was
reserved, whatever the caller passes, and `reap` returns one whose lease ran out (`renew` pushes it ahead while
its request runs): billed what the ledger recorded for it, or refunded (a late settle then bills its real use).
Settled ids are remembered for a while, so a settle sent twice changes nothing. A killed embedded gateway loses
its open reservations with its memory: the restart seeds spend from the ledger alone, where a run that was never
settled has no row, so it is neither billed nor counted twice.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from quotas.backends.base import COUNTER_MAX, Billed, QuotaBackend
from quotas.limits import (
    MAX_DATING_LAG_S,
    WINDOW_S,
    Decision,
    ReservationRequest,
    ScopeLimits,
    Usage,
    dating_instant,
    seconds_to_next_day,
    seconds_to_next_month,
    utc_dates,
)

DONE_TTL_S = 60.0  # a settled id is remembered this long (in one process a settle is never resent later)
REAPED_TTL_S = 86_400.0  # a reaped reservation waits this long for a late settle to bill its real use
MAX_REMEMBERED = 200_000  # settled and reaped ids kept at most, oldest forgotten first


@dataclass(slots=True)
class _Held:
    """An open reservation: what it charged, to which scopes and dates, and until when. Never changed once held
    (`renew` holds a new one): not frozen only because a frozen one costs ~1 us more to build, on every reserve."""

    tenant: str
    scopes: tuple[str, ...]
    tokens: int
    money_pico: int
    day: str
    month: str
    deadline: float


@dataclass
class _ScopeState:
    requests: deque[tuple[float, str]] = field(default_factory=deque)  # (time, request id)
    token_log: deque[tuple[float, str]] = field(default_factory=deque)
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens in the window
    token_sum: int = 0
    inflight: dict[str, float] = field(default_factory=dict)  # request id -> lease deadline
    next_deadline: float = math.inf  # no lease in `inflight` runs out before this
    spent_day: dict[str, int] = field(default_factory=dict)  # YYYYMMDD -> picodollars
    spent_month: dict[str, int] = field(default_factory=dict)  # YYYYMM -> picodollars

    def expire(self, now: float) -> None:
        cutoff = now - WINDOW_S
        while self.requests and self.requests[0][0] <= cutoff:
            self.requests.popleft()
        while self.token_log and self.token_log[0][0] <= cutoff:
            _, rid = self.token_log.popleft()
            self.token_sum -= self.tokens.pop(rid, 0)
        if now >= self.next_deadline:  # a lease ran out (a settle that never came): rare, so scan only then
            for rid in [r for r, deadline in self.inflight.items() if deadline <= now]:
                del self.inflight[rid]
            self.next_deadline = min(self.inflight.values(), default=math.inf)

    def tokens_retry_after(self, need: int, limit: int, now: float) -> float:
        excess = self.token_sum + need - limit
        for ts, rid in self.token_log:
            excess -= self.tokens.get(rid, 0)
            if excess <= 0:
                return ts + WINDOW_S - now
        return WINDOW_S


class MemoryBackend(QuotaBackend):
    name = "memory"

    def __init__(self, *, max_dating_lag_s: float = MAX_DATING_LAG_S) -> None:
        # an arrival dates money at most this long before the request's `now`, as on Redis (one process has one
        # clock, so this only matters to the failover's fallback, whose `now` is Redis' clock as last seen)
        self.max_dating_lag_s = max_dating_lag_s
        self._state: dict[tuple[str, str], _ScopeState] = {}
        self._held: dict[str, _Held] = {}  # request id -> its open reservation
        self._reaped: dict[str, _Held] = {}  # returned by the reaper; a late settle bills its real use
        self._done: set[str] = set()  # settled or billed: a further settle changes nothing
        self._forget_done: deque[tuple[float, str]] = deque()  # (when, id), oldest first
        self._forget_reaped: deque[tuple[float, str]] = deque()

    def _scope(self, tenant: str, scope: str) -> _ScopeState:
        st = self._state.get((tenant, scope))
        if st is None:  # (not `setdefault`: it built a state, six containers, at every call for nothing)
            st = self._state[tenant, scope] = _ScopeState()
        return st

    async def reserve(self, req: ReservationRequest) -> Decision:
        return self.reserve_now(req)

    def reserve_now(self, req: ReservationRequest) -> Decision:
        req = self._dated(req)
        now = req.now
        if req.request_id in self._held:  # the same request again: admitted once, charged once
            return Decision(True)
        if req.request_id in self._done or req.request_id in self._reaped:
            return Decision(False, "duplicate", req.scopes[0].scope if req.scopes else None)
        states = [(lim, self._scope(req.tenant, lim.scope)) for lim in req.scopes]
        day, month = utc_dates(req.day_number)  # (once, not at each read of `req.day`)
        for lim, st in states:
            st.expire(now)
            refusal = _check(lim, st, req, day, month) or _check_fits(lim, st, req, day, month)
            if refusal is not None:
                return refusal
        usage = {}
        for lim, st in states:
            if req.follows is None:
                st.requests.append((now, req.request_id))
            else:  # the client request's place and slot are the attempt's it continues (see `ReservationRequest`)
                st.inflight.pop(req.follows, None)
            st.token_log.append((now, req.request_id))
            st.tokens[req.request_id] = req.tokens
            st.token_sum += req.tokens
            st.inflight[req.request_id] = now + req.lease_s
            st.next_deadline = min(st.next_deadline, now + req.lease_s)
            st.spent_day[day] = st.spent_day.get(day, 0) + req.money_pico
            st.spent_month[month] = st.spent_month.get(month, 0) + req.money_pico
            usage[lim.scope] = Usage(len(st.requests), st.token_sum,
                                     (st.requests[0][0] if st.requests else now) + WINDOW_S - now,
                                     st.token_log[0][0] + WINDOW_S - now)
        self._held[req.request_id] = _Held(req.tenant, tuple(lim.scope for lim in req.scopes), req.tokens,
                                           req.money_pico, day, month, now + req.lease_s)
        return Decision(True, usage=usage)

    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int, keep_slot: bool = False) -> None:
        self.settle_now(req, tokens=tokens, money_pico=money_pico, keep_slot=keep_slot)

    def settles_at_once(self) -> bool:
        return type(self).settle is MemoryBackend.settle  # a subclass's own `settle` may await: it is what runs

    def settle_now(self, req: ReservationRequest, *, tokens: int, money_pico: int, keep_slot: bool = False) -> None:
        req = self._dated(req)  # where nothing is held: billed on the day its reserve dated it
        rid = req.request_id
        self._prune(time.time())
        if rid in self._done:
            return
        if (held := self._held.pop(rid, None)) is not None:
            self._release(rid, held, tokens=tokens, money_delta=money_pico - held.money_pico, keep_slot=keep_slot)
        elif (reaped := self._reaped.pop(rid, None)) is not None:  # its reservation was refunded: bill the use
            self._charge(reaped.tenant, reaped.scopes, reaped.day, reaped.month, money_pico)
        else:  # nothing held (forgotten): add the real use, replace nothing
            self._charge(req.tenant, tuple(lim.scope for lim in req.scopes), req.day, req.month, money_pico)
        self._remember_done(rid)

    async def release(self, req: ReservationRequest) -> None:
        self.release_now(req)

    def release_now(self, req: ReservationRequest) -> None:
        """`req`'s slots freed (`QuotaBackend.release`): whatever holds them, nothing else changed."""
        for lim in req.scopes:
            if (st := self._state.get((req.tenant, lim.scope))) is not None:
                st.inflight.pop(req.request_id, None)

    def holds_slot(self, req: ReservationRequest) -> bool:
        """Whether a scope of `req` still counts its concurrency slot."""
        return any(req.request_id in st.inflight for lim in req.scopes
                   if (st := self._state.get((req.tenant, lim.scope))) is not None)

    def _dated(self, req: ReservationRequest) -> ReservationRequest:
        """`req` with its arrival moved into [now - max_dating_lag_s, now] (quotas/limits.py `dating_instant`)."""
        at = req.dated_at
        if at is None or req.now - self.max_dating_lag_s <= at <= req.now:
            return req
        return replace(req, dated_at=dating_instant(at, req.now, self.max_dating_lag_s))

    async def renew(self, reqs: Sequence[ReservationRequest]) -> None:
        self.renew_now(reqs)

    def renew_now(self, reqs: Sequence[ReservationRequest], *, now: float | None = None) -> None:
        """`renew` where it stands (`now`: the store's clock; the failover's fallback runs on Redis' as last seen).
        A later deadline keeps each scope's `next_deadline` a lower bound."""
        now = time.time() if now is None else now
        for req in reqs:
            rid = req.request_id
            deadline = now + req.lease_s
            if (held := self._held.get(rid)) is not None:
                self._held[rid] = replace(held, deadline=max(held.deadline, deadline))
            # a slot kept past its settle (`keep_slot`) is renewed as long as it is held, as its reservation was
            for lim in req.scopes:
                st = self._state.get((req.tenant, lim.scope))
                if st is not None and rid in st.inflight:
                    st.inflight[rid] = max(st.inflight[rid], deadline)

    def expired(self, now: float) -> list[str]:
        """Open reservations whose lease ran out (a settle that never came)."""
        return [rid for rid, held in self._held.items() if held.deadline <= now]

    async def reap(self, billed: Billed | None = None, *, now: float | None = None) -> int:
        now = time.time() if now is None else now
        ids = self.expired(now)
        amounts = await billed(ids) if ids and billed is not None else {}
        returned = 0
        for rid in ids:
            held = self._held.pop(rid, None)
            if held is None:  # settled while the ledger was read
                continue
            returned += 1
            if rid in amounts:  # its row was written: bill that, and let no later settle change it
                self._release(rid, held, tokens=0, money_delta=amounts[rid] - held.money_pico)
                self._remember_done(rid)
            else:
                self._release(rid, held, tokens=None, money_delta=-held.money_pico)
                self._reaped[rid] = held
                self._forget_reaped.append((time.time() + REAPED_TTL_S, rid))
        return returned

    def _release(self, rid: str, held: _Held, *, tokens: int | None, money_delta: int,
                 keep_slot: bool = False) -> None:
        """Free the slot (unless `keep_slot`: `release_now` frees it), set the window's tokens to `tokens` (None: take
        them out) and move the money, each counter capped at COUNTER_MAX as settle.lua caps it (`_add_capped`)."""
        day, month = held.day, held.month
        for scope in held.scopes:  # (`_charge`'s work in the same pass: one lookup of each scope's state)
            st = self._scope(held.tenant, scope)
            if (was := st.tokens.get(rid)) is not None:
                new = 0 if tokens is None else tokens
                st.token_sum = _add_capped(st.token_sum, new - was)
                st.tokens[rid] = new
            if not keep_slot:
                st.inflight.pop(rid, None)
            st.spent_day[day] = _add_capped(st.spent_day.get(day, 0), money_delta)
            st.spent_month[month] = _add_capped(st.spent_month.get(month, 0), money_delta)

    def _charge(self, tenant: str, scopes: Sequence[str], day: str, month: str, pico: int) -> None:
        for scope in scopes:
            st = self._scope(tenant, scope)
            st.spent_day[day] = _add_capped(st.spent_day.get(day, 0), pico)
            st.spent_month[month] = _add_capped(st.spent_month.get(month, 0), pico)

    def _remember_done(self, rid: str) -> None:
        self._done.add(rid)
        self._forget_done.append((time.time() + DONE_TTL_S, rid))

    def _prune(self, now: float) -> None:
        while self._forget_done and (self._forget_done[0][0] <= now or len(self._forget_done) > MAX_REMEMBERED):
            self._done.discard(self._forget_done.popleft()[1])
        while self._forget_reaped and (self._forget_reaped[0][0] <= now
                                       or len(self._forget_reaped) > MAX_REMEMBERED):
            self._reaped.pop(self._forget_reaped.popleft()[1], None)

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        day, month = _day_month(now)
        return {scope: self.spend_of(tenant, scope, day, month) for scope in scopes}

    def seed(self, tenant: str, scope: str, *, day: str, month: str, spent_day_pico: int,
             spent_month_pico: int, recent: list[tuple[float, str, int]]) -> None:
        """Restore budgets and the last minute's requests and tokens from the ledger."""
        st = self._scope(tenant, scope)
        st.spent_day[day] = spent_day_pico
        st.spent_month[month] = spent_month_pico
        for ts, rid, tokens in sorted(recent):
            st.requests.append((ts, rid))
            st.token_log.append((ts, rid))
            st.tokens[rid] = tokens
            st.token_sum += tokens

    def spend_of(self, tenant: str, scope: str, day: str, month: str) -> tuple[int, int]:
        st = self._state.get((tenant, scope))
        return (st.spent_day.get(day, 0), st.spent_month.get(month, 0)) if st else (0, 0)

    def seed_spend(self, tenant: str, scope: str, *, day: str, month: str, day_pico: int, month_pico: int) -> None:
        """Raise a scope's spend to what another source last knew (a shared store, the ledger); never lower it,
        so seeding twice, or with what this process already counted, counts nothing twice."""
        st = self._scope(tenant, scope)
        st.spent_day[day] = max(st.spent_day.get(day, 0), day_pico)
        st.spent_month[month] = max(st.spent_month.get(month, 0), month_pico)


def _check(lim: ScopeLimits, st: _ScopeState, req: ReservationRequest, day: str, month: str) -> Decision | None:
    now = req.now
    if lim.rpm is not None and req.follows is None and len(st.requests) + 1 > lim.rpm:
        wait = st.requests[0][0] + WINDOW_S - now if st.requests else WINDOW_S
        return Decision(False, "rpm", lim.scope, wait)
    if lim.tpm is not None and st.token_sum + req.tokens > lim.tpm:
        return Decision(False, "tpm", lim.scope, st.tokens_retry_after(req.tokens, lim.tpm, now))
    slot = 0 if req.follows is not None and req.follows in st.inflight else 1  # a slot taken over is no new one
    if lim.max_concurrent is not None and len(st.inflight) + slot > lim.max_concurrent:
        return Decision(False, "concurrency", lim.scope, 1.0)
    if lim.budget_day_pico is not None and st.spent_day.get(day, 0) + req.money_pico > lim.budget_day_pico:
        return Decision(False, "budget_day", lim.scope, _period_left(req, seconds_to_next_day))
    if (lim.budget_month_pico is not None
            and st.spent_month.get(month, 0) + req.money_pico > lim.budget_month_pico):
        return Decision(False, "budget_month", lim.scope, _period_left(req, seconds_to_next_month))
    return None


def _check_fits(lim: ScopeLimits, st: _ScopeState, req: ReservationRequest, day: str, month: str) -> Decision | None:
    """The refusal of a request that would carry a counter of the scope past COUNTER_MAX: Python's integers do not
    overflow, but Redis' do (reserve.lua refuses there, for the same reasons), and both stores refuse the same."""
    if st.token_sum + req.tokens > COUNTER_MAX:
        return Decision(False, "overflow_tpm", lim.scope, WINDOW_S)
    if req.money_pico > 0 and st.spent_day.get(day, 0) + req.money_pico > COUNTER_MAX:
        return Decision(False, "overflow_day", lim.scope, _period_left(req, seconds_to_next_day))
    if req.money_pico > 0 and st.spent_month.get(month, 0) + req.money_pico > COUNTER_MAX:
        return Decision(False, "overflow_month", lim.scope, _period_left(req, seconds_to_next_month))
    return None


def _period_left(req: ReservationRequest, seconds_to_next: Callable[[float], float]) -> float:
    """The seconds from `req.now` to the end of the day or month (`seconds_to_next`) its money is dated in: its
    arrival's (clamped by `_dated`), a period that may have ended before `now` (no wait then)."""
    dated = req.now if req.dated_at is None else req.dated_at
    return max(0.0, seconds_to_next(dated) + dated - req.now)


def _add_capped(held: int, delta: int) -> int:
    """`held` + `delta`, or COUNTER_MAX where an increase would carry it past it, as shared.lua's `add_capped` leaves a
    counter that a settle or a charge adds to (a decrease is never capped): a settle applies whole, and the counter
    refuses every later increase as Redis' does (`_check_fits`)."""
    total = held + delta
    return COUNTER_MAX if delta > 0 and total > COUNTER_MAX else total


def _day_month(now: float) -> tuple[str, str]:
    t = time.gmtime(now)
    return time.strftime("%Y%m%d", t), time.strftime("%Y%m", t)
