"""Calls to a tier that no client waits for: a rollout's shadow (gateway/rollout/shadow.py) and the check of a
sampled semantic cache hit (gateway/pipeline/cache_check.py).

They go to the tier's replicas without a dispatch slot, a reservation, a ledger row or the cache: the tenant is
billed nothing and sees nothing; what they cost us their callers count. Each is still the tenant's request it copies
(a shadow) or checks (a cache check), and goes as one (`tenant`, `end_user`): the replica's breaker keeps its failure
under that tenant (a tenant's inputs the tier chokes on, copied off path, open no breaker for everyone when its
direct requests could not), and the tier gets the tenant's hashed hints and prefix-cache namespace, as the direct
call's body has them (tier_call.py `forwarded`), not the tier's shared namespace. `OffPathTasks` keeps at most
`max_in_flight` of them running, and at most `max_per_owner` for any one owner (a tenant) where the caller names
one; one more is dropped (the caller counts it), so a slow tier cannot pile up work in the gateway, and one
tenant's hits cannot take every place and leave other tenants' error bounds unchecked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Hashable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gateway.errors import client_error
from gateway.pipeline.meter import Meter, Outcome
from gateway.pipeline.tier_call import TierCaller
from tiers.catalogue import TierSpec

log = logging.getLogger("tiergate.gateway")


@dataclass(frozen=True)
class OffPathAnswer:
    outcome: Outcome  # the answer as far as it came, its tokens and times
    failed: bool  # the call raised
    error: bool  # ... with a 5xx: the tier's fault, not the request's

    def cost(self, tier: TierSpec) -> Decimal:
        """What the call cost us in the tier's hardware time (the engine's busy time where it reports it)."""
        seconds = self.outcome.busy_s if self.outcome.busy_s is not None else self.outcome.upstream_s
        return tier.compute_cost(seconds or 0.0)


async def answer_off_path(caller: TierCaller, tier: TierSpec, body: dict[str, Any], *, tenant: str | None,
                          end_user: str | None = None) -> OffPathAnswer:
    """The tier's whole answer to `body`, sent as `tenant`'s (and its isolated `end_user`'s: TierCaller.open); a
    failure is returned, never raised."""
    meter = Meter(time.perf_counter())
    meter.upstream_started()
    failed = error = False
    try:
        async for chunk in await caller.open(tier, body, affinity=None, tenant=tenant, end_user=end_user):
            meter.add(chunk)
    except Exception as exc:
        failed, error = True, client_error(exc).status_code >= 500
        log.info("off-path call to %s failed: %s", tier.name, exc)
    finally:
        meter.upstream_ended()
    return OffPathAnswer(meter.outcome("error" if error else "ok", 200), failed, error)


class OffPathTasks:
    def __init__(self, max_in_flight: int, max_per_owner: int | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.max_per_owner = max_per_owner
        self._tasks: set[asyncio.Task[None]] = set()
        self._owners: dict[Hashable, int] = {}  # owner -> its tasks running

    def start(self, work: Coroutine[Any, Any, None], owner: Hashable = None) -> bool:
        """Run `work` in the background; False (and `work` never run) when `max_in_flight` already run, or
        `max_per_owner` of `owner`'s (None: no owner)."""
        mine = self._owners.get(owner, 0) if owner is not None else 0
        if len(self._tasks) >= self.max_in_flight or (self.max_per_owner is not None and owner is not None
                                                      and mine >= self.max_per_owner):
            work.close()
            return False
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if owner is not None:
            self._owners[owner] = mine + 1
            task.add_done_callback(lambda _: self._left(owner))
        return True

    def _left(self, owner: Hashable) -> None:
        if (left := self._owners.get(owner, 1) - 1) > 0:
            self._owners[owner] = left
        else:
            self._owners.pop(owner, None)

    async def drain(self) -> None:
        """Wait for the calls in flight (tests)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def cancel(self) -> None:
        """Stop the calls in flight (shutdown): nobody waits for their answers."""
        for task in list(self._tasks):
            task.cancel()
