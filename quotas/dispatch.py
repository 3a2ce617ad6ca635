"""Per-tier dispatch: a bounded queue in front of each tier, priority classes first, then fair share.

Inside a priority class the next request comes from the tenant that has been served the fewest weighted
tokens (the Virtual Token Counter of Sheng et al., OSDI'24): a flooding tenant waits behind itself. A
tenant that becomes backlogged again is lifted to the smallest counter among backlogged tenants, so
idle time is not banked as credit. Dispatch never exceeds the tier's capacity (its replicas' slots).

VTC orders the queue, but a newcomer still waits for a slot to free, which is a whole request of the
flooder's. So one slot (where capacity allows) is kept for tenants with nothing in flight: a flood can
hold all slots but one, and another tenant's request starts at once. `fifo` is the plain baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Literal

RATE_TENANTS = 64  # tenants whose recent token rate is kept (the least recently updated one's dropped)


class QueueFull(Exception):
    """The tier's dispatch queue is at its bound."""


@dataclass
class Ticket:
    tenant: str
    priority: int  # 0 is served first
    weight: float
    tokens: int  # the reserved estimate: prompt + output cap
    seq: int
    arrival: float = field(default_factory=time.monotonic)
    dispatched_at: float | None = None
    future: asyncio.Future[None] | None = None


class TierQueue:
    def __init__(self, tier: str, capacity: int, *, max_waiting: int | None = None,
                 policy: Literal["vtc", "fifo"] = "vtc", reserved_slots: int | None = None) -> None:
        self.tier = tier
        self.capacity = capacity
        self.policy = policy
        # slots only a tenant with nothing in flight may take
        self.reserved_slots = (1 if capacity >= 4 else 0) if reserved_slots is None else reserved_slots
        if policy == "fifo":
            self.reserved_slots = 0
        self.in_flight_by: dict[str, int] = defaultdict(int)  # tenant -> dispatched
        self.max_waiting = max_waiting if max_waiting is not None else 64 * capacity
        self.in_flight = 0
        self.waiting: dict[int, list[Ticket]] = defaultdict(list)  # priority -> FIFO
        self.counters: dict[int, dict[str, float]] = defaultdict(dict)  # priority -> tenant -> VTC
        self.active: dict[tuple[int, str], int] = defaultdict(int)  # (priority, tenant) -> queued + in flight
        # measured: the tier's aggregate token rate, the median (high) of each recent tenant's EWMA of it, so one
        # tenant reading its streams slowly (its slots held, its rate low) does not make every plan's predicted
        # wait pass its bound; with one tenant, its own
        self.tokens_per_s: float | None = None
        self._rates: OrderedDict[str, float] = OrderedDict()  # tenant -> EWMA, most recently updated last
        self._seq = itertools.count()

    # ---- admission ----

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def tokens_ahead(self, priority: int, tenant: str | None = None, weight: float = 1.0) -> float:
        """Tokens queued that would be dispatched before a new request of this priority (of `tenant`, whose plan
        weighs `weight`; None: every queued one, as FIFO would serve them).

        Under VTC a tenant's new request does not wait for everything queued in its class: it goes when its counter
        is the lowest. So the same class counts, besides the tenant's own queued tokens, each other tenant's tickets
        in their order for as long as that tenant's counter (charged at each dispatch, ties to the older ticket)
        stays at or below the counter this tenant will have when its request is next. One tenant's backlog then
        predicts no wait for the others, whom fair share serves first: before, a tenant flooding a tier made every
        plan's predicted wait pass its `max_queue_wait_s`, and the others were refused (503) or shed."""
        ahead = float(sum(t.tokens for p, q in self.waiting.items() if p < priority for t in q))
        same = self.waiting.get(priority, ())
        if tenant is None or self.policy == "fifo":
            return ahead + sum(t.tokens for t in same)
        counters = self.counters[priority]
        own = counters.get(tenant, 0.0)
        backlogged = self._backlogged(priority)
        if backlogged and not self.active.get((priority, tenant)):  # lifted as `_lift` lifts a newcomer
            own = max(own, min(backlogged))
        own_queued = sum(t.tokens for t in same if t.tenant == tenant)
        finish = own + own_queued / weight
        ahead += own_queued
        charged: dict[str, float] = {}
        for t in same:
            if t.tenant == tenant:
                continue
            c = charged.get(t.tenant, counters.get(t.tenant, 0.0))
            if c <= finish:
                ahead += t.tokens
                c += t.tokens / t.weight
            charged[t.tenant] = c
        return ahead

    def predicted_wait_s(self, priority: int, tenant: str | None = None, weight: float = 1.0) -> float:
        """Tokens ahead (`tokens_ahead`) over the measured throughput; 0 while a slot is free or nothing is
        measured."""
        if self.in_flight < self.capacity and not self.num_waiting:
            return 0.0
        if not self.tokens_per_s:
            return 0.0
        return self.tokens_ahead(priority, tenant, weight) / self.tokens_per_s

    # ---- dispatch ----

    async def acquire(self, tenant: str, *, priority: int, weight: float, tokens: int) -> Ticket:
        """Wait for a slot; leaving early (cancellation) gives the place up."""
        ticket = Ticket(tenant, priority, weight, tokens, next(self._seq))
        if self.active[priority, tenant] == 0:
            self._lift(ticket)
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"tier {self.tier!r} has {self.num_waiting} requests waiting (its bound)")
        ticket.future = asyncio.get_running_loop().create_future()
        self.active[priority, tenant] += 1
        self.waiting[priority].append(ticket)
        self._next()  # dispatches it at once when a slot fits it
        try:
            await ticket.future
        except asyncio.CancelledError:
            if ticket.dispatched_at is None:
                self.waiting[priority].remove(ticket)
                self.active[priority, tenant] -= 1
            else:
                self.release(ticket, 0)
            raise
        return ticket

    def release(self, ticket: Ticket, served_tokens: int) -> None:
        """The request finished: correct its counter to the tokens really served, free its slot."""
        if ticket.dispatched_at is None:
            return
        counters = self.counters[ticket.priority]
        counters[ticket.tenant] = counters.get(ticket.tenant, 0.0) + (served_tokens - ticket.tokens) / ticket.weight
        elapsed = time.monotonic() - ticket.dispatched_at
        if served_tokens > 0 and elapsed > 0:
            rate = served_tokens / elapsed * max(1, self.in_flight)
            old = self._rates.pop(ticket.tenant, None)
            self._rates[ticket.tenant] = rate if old is None else 0.8 * old + 0.2 * rate
            if len(self._rates) > RATE_TENANTS:
                self._rates.popitem(last=False)
            self.tokens_per_s = statistics.median_high(self._rates.values())
        ticket.dispatched_at = None
        self.in_flight -= 1
        self.in_flight_by[ticket.tenant] -= 1
        self.active[ticket.priority, ticket.tenant] -= 1
        self._next()

    def _dispatch(self, ticket: Ticket) -> None:
        counters = self.counters[ticket.priority]
        counters[ticket.tenant] = counters.get(ticket.tenant, 0.0) + ticket.tokens / ticket.weight
        ticket.dispatched_at = time.monotonic()
        self.in_flight += 1
        self.in_flight_by[ticket.tenant] += 1
        if ticket.future is not None and not ticket.future.done():
            ticket.future.set_result(None)

    def _fits(self, tenant: str) -> bool:
        """A slot is free for this tenant: any slot if it has nothing in flight, else an unreserved one."""
        if self.in_flight >= self.capacity:
            return False
        return self.in_flight_by[tenant] == 0 or self.in_flight < self.capacity - self.reserved_slots

    def _next(self) -> None:
        while self.in_flight < self.capacity:
            ticket = self._pick()
            if ticket is None:
                return
            self._dispatch(ticket)

    def _pick(self) -> Ticket | None:
        for priority in sorted(p for p, q in self.waiting.items() if q):
            queue = [t for t in self.waiting[priority] if self._fits(t.tenant)]
            if not queue:
                continue
            if self.policy == "fifo":
                best = min(queue, key=lambda t: t.seq)
            else:
                counters = self.counters[priority]
                best = min(queue, key=lambda t: (counters.get(t.tenant, 0.0), t.seq))
            self.waiting[priority].remove(best)
            return best
        return None

    def _backlogged(self, priority: int) -> list[float]:
        """The counters of the class's tenants with requests queued or in flight."""
        counters = self.counters[priority]
        return [counters[t] for (p, t), n in self.active.items() if p == priority and n > 0 and t in counters]

    def _lift(self, ticket: Ticket) -> None:
        counters = self.counters[ticket.priority]
        backlogged = self._backlogged(ticket.priority)
        if backlogged:
            counters[ticket.tenant] = max(counters.get(ticket.tenant, 0.0), min(backlogged))
