"""What the gateway does when Redis fails: fail open within a local safety limit, or fail closed.

`open`: reservations go to an in-process memory backend with the same limits (so one replica can never
exceed them on its own) until Redis answers again. `closed`: reservations raise, and the gateway answers
503. Each change of state is logged once and counted; Redis is tried again at most once a second, so a
dead Redis does not add its timeout to every request.

A refused connection means Redis is down at once. A timeout alone does not (a busy event loop can cause
one): the request gets a retryable 503, and only timeouts that go on for `DOWN_AFTER_S` without a success
in between switch the mode, so a burst of load never quietly turns shared limits into per-replica ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal

from quotas.backends.base import QuotaBackend, QuotaBackendError
from quotas.backends.memory import MemoryBackend
from quotas.limits import Decision, ReservationRequest

log = logging.getLogger("tiergate.quotas")
RETRY_EVERY_S = 1.0
DOWN_AFTER_S = 1.0  # timeouts with no success in between for this long mean Redis is down


class FailoverBackend(QuotaBackend):
    name = "failover"

    def __init__(self, primary: QuotaBackend, *, mode: Literal["open", "closed"] = "open",
                 on_state: Callable[[bool], None] | None = None) -> None:
        self.primary = primary
        self.local = MemoryBackend()
        self.mode = mode
        self.up = True
        self._retry_at = 0.0
        self._on_state = on_state
        self._local_ids: set[str] = set()  # reservations made while the primary was down
        self._failing_since: float | None = None

    def _mark(self, up: bool, why: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log.warning("quota backend %s is back; shared limits resume", self.primary.name)
        else:
            log.error("quota backend %s failed (%s); failing %s", self.primary.name, why, self.mode)
        if self._on_state:
            self._on_state(up)

    async def reserve(self, req: ReservationRequest) -> Decision:
        if self.up or time.monotonic() >= self._retry_at:
            try:
                decision = await self.primary.reserve(req)
                self._failing_since = None
                self._mark(True)
                return decision
            except QuotaBackendError as exc:
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since = now
                if self.up and exc.transient and now - self._failing_since < DOWN_AFTER_S:
                    raise
                self._retry_at = time.monotonic() + RETRY_EVERY_S
                self._mark(False, str(exc))
        if self.mode == "closed":
            raise QuotaBackendError(f"{self.primary.name} is unavailable and the gateway fails closed")
        self._local_ids.add(req.request_id)
        return await self.local.reserve(req)

    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int) -> None:
        if req.request_id in self._local_ids:
            self._local_ids.discard(req.request_id)
            await self.local.settle(req, tokens=tokens, money_pico=money_pico)
            return
        try:
            await self.primary.settle(req, tokens=tokens, money_pico=money_pico)
        except QuotaBackendError as exc:
            # the reservation stays charged at its upper bound: budgets err on the safe side
            self._mark(False, str(exc))

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        """The primary's figures while it answers; while it is down, the local ones (what this replica saw)."""
        if self.up:
            return await self.primary.spent(tenant, scopes, now)
        return await self.local.spent(tenant, scopes, now)

    async def close(self) -> None:
        await self.primary.close()
