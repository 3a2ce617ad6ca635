"""Dispatch: wait for the tier's dispatch slot (priority class first, then fair share; quotas/dispatch.py).

A request that leaves while it waits gives its place up and never takes a slot; the slot of one that was
dispatched is freed by the settle stage with the tokens it really used (the fair-share counters' input).
"""

from __future__ import annotations

import time

from gateway.errors import Unavailable
from gateway.ladder.signals import Signals
from gateway.metrics import GatewayMetrics
from quotas.dispatch import QueueFull, Ticket, TierQueue
from quotas.plans import PRIORITY_ORDER, Plan


class DispatchStage:
    def __init__(self, *, queues: dict[str, TierQueue], metrics: GatewayMetrics, signals: Signals) -> None:
        self.queues = queues
        self.metrics = metrics
        self.signals = signals

    async def acquire(self, tenant: str, plan: Plan, tier: str, tokens: int) -> Ticket:
        """The slot, once dispatched; `Unavailable` (503, nothing held) when the tier's queue is full."""
        t0 = time.perf_counter()
        try:
            ticket = await self.queues[tier].acquire(tenant, priority=PRIORITY_ORDER[plan.priority],
                                                     weight=plan.weight, tokens=tokens)
        except QueueFull as exc:
            raise Unavailable(str(exc), code="queue_full", retry_after=1) from exc
        waited = time.perf_counter() - t0
        self.metrics.child(self.metrics.queue_wait, tier).observe(waited)
        self.signals.queue_wait(waited, tenant)  # one tenant's flood does not move the ladder
        return ticket

    def release(self, tier: str, ticket: Ticket, served_tokens: int) -> None:
        self.queues[tier].release(ticket, served_tokens)

    def predicted_waits(self, plan: Plan, tenant: str) -> dict[str, float]:
        """Each allowed tier's predicted wait for the tenant's next request in its plan's priority class (the
        router's load signal): fair share between tenants, so another tenant's backlog is not the tenant's wait."""
        priority = PRIORITY_ORDER[plan.priority]
        return {t: self.queues[t].predicted_wait_s(priority, tenant, plan.weight)
                for t in plan.allowed_tiers if t in self.queues}
