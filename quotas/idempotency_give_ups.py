"""PostgreSQL's give-ups owed in the background (quotas/idempotency_postgres.py): a claim whose reply was lost may have
committed, and an abandon the database refused left its claim in place; either would hold its key for the lease
(600 s), and the client's retry would be told 409 meanwhile. Each is owed here and deleted once the database answers,
so the retry runs (once) instead.

A give-up deletes one request's running claim (tenant, key and owner: a request id no other request has), which that
request will not run: no other request's claim or answer is touched, and a claim that was never made deletes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from quotas.ledger import LedgerUnavailable

log = logging.getLogger("tiergate.idempotency")

GIVE_UP_DELAYS_S = (0.05, 5.0)  # between rounds of owed give-ups: the first, the most (under the gateway's 10 s wait)
MAX_GIVE_UPS = 10_000  # claims owed a give-up at most
GIVE_UP_FOR_S = 900.0  # how long an abandon the database refused is owed (longer than the gateway's lease, 600 s)

At = tuple[str, str, str]  # a claim: (tenant, key, owner)


class GiveUps:
    """Claims owed a give-up, deleted by `give_up` (which raises `LedgerUnavailable` while the database refuses)."""

    def __init__(self, give_up: Callable[[At], Awaitable[object]]) -> None:
        self._give_up = give_up
        self._owed: dict[At, float] = {}  # at: until when (time.monotonic())
        self._worker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._owed)

    def owe(self, at: At, for_s: float) -> None:
        """Owe the give-up of `at`'s running claim, if any, for `for_s`."""
        if at not in self._owed and len(self._owed) >= MAX_GIVE_UPS:
            log.error("too many idempotency claims owed a give-up: key %r (tenant %s) stays claimed until its lease "
                      "ends", at[1], at[0])
            return
        self._owed[at] = time.monotonic() + for_s
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Delete the owed claims, oldest first; a round stops at the first failure and the next waits longer."""
        delay = GIVE_UP_DELAYS_S[0]
        while self._owed:
            for at, until in list(self._owed.items()):
                if until > time.monotonic():
                    try:
                        await self._give_up(at)
                    except LedgerUnavailable:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, GIVE_UP_DELAYS_S[1])
                        break
                if self._owed.get(at) == until:
                    del self._owed[at]
            else:
                delay = GIVE_UP_DELAYS_S[0]

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._owed:
            log.error("closing with %d idempotency claims owed a give-up: their keys stay claimed until their "
                      "leases end", len(self._owed))
