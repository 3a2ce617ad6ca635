"""What a replica still owes Redis after a call whose answer it did not get: the part of `RedisBackend`
(quotas/backends/redis.py) that retries, in the background, a settle Redis did not answer and the cancel of a
reserve whose answer was lost (the script may have run: what it holds is undone, so the client's retry finds its
rpm place, tokens, slot and money free). settle.lua makes a repeat of either harmless, in any order with the other
and with a settle of the same id from a replica's fallback (quotas/backends/failover.py).

Retries wait twice as long each time, up to SETTLE_BACKOFF_S[1] (quotas/backends/settle_backoff.py), for
`settle_retry_s`; after that a reservation still held is the reaper's, once its lease runs out. An outage's failures
are logged once, then one line when a settle works again (FaultLog), not a line a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from quotas.backends import settle_backoff
from quotas.backends.base import QuotaBackendError
from quotas.fault_log import FaultLog
from quotas.limits import WINDOW_S, ReservationRequest

log = logging.getLogger("tiergate.quotas")

CANCEL_ATTEMPTS = 20  # undoing a reservation whose answer was lost: tries a second apart, then as a settle's retries


class RedisRetries:
    """Mixed into `RedisBackend`, whose settles (`_finish`) and cancels (`cancel`) it retries."""

    _finish: Callable[..., Awaitable[int]]
    cancel: Callable[[ReservationRequest], Awaitable[None]]

    def __init__(self, settle_retry_s: float) -> None:
        self.settle_retry_s = settle_retry_s
        self.num_settle_retries = 0  # settles that failed once and went to the background
        # an outage's failed settles (every request in flight as it began) in the log once, then one line when one
        # works again: not a line each, and another each as its retries give up
        self._settle_faults = FaultLog(log, "settling reservations in Redis (retried in the background)",
                                       rounds="settles")
        self._background: set[asyncio.Task[None]] = set()  # held so they are not collected before they finish

    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int, keep_slot: bool = False) -> None:
        """One try now; if Redis does not answer, retries in the background (see `_retry_settle`)."""
        try:
            await self._finish(req, tokens=tokens, money_pico=money_pico, kind="settle", keep_slot=keep_slot)
        except QuotaBackendError as exc:
            self.num_settle_retries += 1
            self._settle_faults.failed(exc)
            self._spawn(self._retry_settle(req, tokens, money_pico, keep_slot))
        else:
            self._settle_faults.ok()

    async def _retry_settle(self, req: ReservationRequest, tokens: int, money_pico: int, keep_slot: bool) -> None:
        """Until Redis answers (settle.lua makes a repeat harmless), waiting twice as long each time up to
        SETTLE_BACKOFF_S[1]; after `settle_retry_s` the reservation is left to the reaper. A settle that keeps the
        slot keeps it on every try: a slot released meanwhile is not there to keep, and none is ever taken."""
        if await self._retry(lambda: self._finish(req, tokens=tokens, money_pico=money_pico, kind="settle",
                                                  keep_slot=keep_slot),
                             settle_backoff.SETTLE_BACKOFF_S[0], self.settle_retry_s):
            self._settle_faults.ok()
        else:
            self._settle_faults.failed(QuotaBackendError(
                f"a settle retried for {self.settle_retry_s:g}s is given up: its lease's reaper returns it"))

    async def _cancel_lost(self, req: ReservationRequest) -> None:
        """One try now; if Redis does not answer, retried in the background (`_retry_cancel`)."""
        try:
            await self.cancel(req)
        except QuotaBackendError:
            self._spawn(self._retry_cancel(req))

    async def _retry_cancel(self, req: ReservationRequest) -> None:
        """CANCEL_ATTEMPTS tries a second apart, then with a settle's backoff, for as long as a settle is retried and
        at least a window (WINDOW_S). Given up after its 20 tries (an outage of over 20 s), the request's rpm place
        and tokens stayed taken until the window passed, and its concurrency slot and money until its lease ran out
        (the reaper's return, which leaves the rpm window alone): capacity of a request never admitted."""
        for _ in range(CANCEL_ATTEMPTS):
            await asyncio.sleep(1.0)
            try:
                await self.cancel(req)
                return
            except QuotaBackendError:
                pass
        if not await self._retry(lambda: self.cancel(req), 1.0, max(self.settle_retry_s, WINDOW_S)):
            self._settle_faults.failed(QuotaBackendError(
                "undoing a reservation whose answer was lost is given up: its lease's reaper returns it"))

    async def _retry(self, call: Callable[[], Awaitable[Any]], wait: float, for_s: float) -> bool:
        return await settle_backoff.retry(call, wait, for_s)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
