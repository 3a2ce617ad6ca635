"""In-process quota state for a single gateway (the embedded default), exact under asyncio.

Reservations and settlements run on the event loop without awaiting in between, so each is atomic.
Budgets survive restarts because the gateway seeds them from the durable ledger at start-up (`seed`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from quotas.backends.base import QuotaBackend
from quotas.limits import (
    WINDOW_S,
    Decision,
    ReservationRequest,
    ScopeLimits,
    Usage,
    seconds_to_next_day,
    seconds_to_next_month,
)


@dataclass
class _ScopeState:
    requests: deque[tuple[float, str]] = field(default_factory=deque)  # (time, request id)
    token_log: deque[tuple[float, str]] = field(default_factory=deque)
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens in the window
    token_sum: int = 0
    inflight: dict[str, float] = field(default_factory=dict)  # request id -> lease deadline
    spent_day: dict[str, int] = field(default_factory=dict)  # YYYYMMDD -> picodollars
    spent_month: dict[str, int] = field(default_factory=dict)  # YYYYMM -> picodollars

    def expire(self, now: float) -> None:
        cutoff = now - WINDOW_S
        while self.requests and self.requests[0][0] <= cutoff:
            self.requests.popleft()
        while self.token_log and self.token_log[0][0] <= cutoff:
            _, rid = self.token_log.popleft()
            self.token_sum -= self.tokens.pop(rid, 0)
        for rid in [r for r, deadline in self.inflight.items() if deadline <= now]:
            del self.inflight[rid]

    def tokens_retry_after(self, need: int, limit: int, now: float) -> float:
        excess = self.token_sum + need - limit
        for ts, rid in self.token_log:
            excess -= self.tokens.get(rid, 0)
            if excess <= 0:
                return ts + WINDOW_S - now
        return WINDOW_S


class MemoryBackend(QuotaBackend):
    name = "memory"

    def __init__(self) -> None:
        self._state: dict[tuple[str, str], _ScopeState] = {}

    def _scope(self, tenant: str, scope: str) -> _ScopeState:
        return self._state.setdefault((tenant, scope), _ScopeState())

    async def reserve(self, req: ReservationRequest) -> Decision:
        return self.reserve_now(req)

    def reserve_now(self, req: ReservationRequest) -> Decision:
        now = req.now
        states = [(lim, self._scope(req.tenant, lim.scope)) for lim in req.scopes]
        for lim, st in states:
            st.expire(now)
            refusal = _check(lim, st, req)
            if refusal is not None:
                return refusal
        usage = {}
        for lim, st in states:
            st.requests.append((now, req.request_id))
            st.token_log.append((now, req.request_id))
            st.tokens[req.request_id] = req.tokens
            st.token_sum += req.tokens
            st.inflight[req.request_id] = now + req.lease_s
            st.spent_day[req.day] = st.spent_day.get(req.day, 0) + req.money_pico
            st.spent_month[req.month] = st.spent_month.get(req.month, 0) + req.money_pico
            usage[lim.scope] = Usage(len(st.requests), st.token_sum, st.requests[0][0] + WINDOW_S - now,
                                     st.token_log[0][0] + WINDOW_S - now)
        return Decision(True, usage=usage)

    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int) -> None:
        for lim in req.scopes:
            st = self._scope(req.tenant, lim.scope)
            if req.request_id in st.tokens:
                st.token_sum += tokens - st.tokens[req.request_id]
                st.tokens[req.request_id] = tokens
            st.inflight.pop(req.request_id, None)
            delta = money_pico - req.money_pico
            st.spent_day[req.day] = st.spent_day.get(req.day, 0) + delta
            st.spent_month[req.month] = st.spent_month.get(req.month, 0) + delta

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        day, month = _day_month(now)
        out = {}
        for scope in scopes:
            st = self._state.get((tenant, scope))
            out[scope] = (st.spent_day.get(day, 0), st.spent_month.get(month, 0)) if st else (0, 0)
        return out

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


def _check(lim: ScopeLimits, st: _ScopeState, req: ReservationRequest) -> Decision | None:
    now = req.now
    if lim.rpm is not None and len(st.requests) + 1 > lim.rpm:
        wait = st.requests[0][0] + WINDOW_S - now if st.requests else WINDOW_S
        return Decision(False, "rpm", lim.scope, wait)
    if lim.tpm is not None and st.token_sum + req.tokens > lim.tpm:
        return Decision(False, "tpm", lim.scope, st.tokens_retry_after(req.tokens, lim.tpm, now))
    if lim.max_concurrent is not None and len(st.inflight) + 1 > lim.max_concurrent:
        return Decision(False, "concurrency", lim.scope, 1.0)
    if lim.budget_day_pico is not None and st.spent_day.get(req.day, 0) + req.money_pico > lim.budget_day_pico:
        return Decision(False, "budget_day", lim.scope, seconds_to_next_day(now))
    if (lim.budget_month_pico is not None
            and st.spent_month.get(req.month, 0) + req.money_pico > lim.budget_month_pico):
        return Decision(False, "budget_month", lim.scope, seconds_to_next_month(now))
    return None


def _day_month(now: float) -> tuple[str, str]:
    t = time.gmtime(now)
    return time.strftime("%Y%m%d", t), time.strftime("%Y%m", t)
