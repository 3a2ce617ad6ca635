"""The quota backend boundary.

What crosses it: a `ReservationRequest` (who, which scopes with which limits, how many tokens and
picodollars to reserve) goes in; a `Decision` comes out. `settle` later replaces the reservation by the
real usage. Every implementation is atomic per request: all scopes' limits are checked and charged
together, or nothing is charged at all.

Every reservation comes back. A reservation carries its own amounts and a lease; `reap` returns those
whose lease ran out (a replica was killed between reserve and settle) exactly once, billing what the
ledger recorded for them if anything, else nothing. A request that runs longer than a part of its lease
has it pushed ahead (`renew`) by its live replica, so a long answer is never taken for a dead replica's.
`settle` is idempotent: sent twice (an answer lost on the way back), it changes nothing the second time;
sent for a reaped or unknown reservation, it adds the real use instead of replacing a reservation.

A settle frees the reservation's concurrency slot, unless told to keep it (`keep_slot`: the request's answer is
written down and billed, but not yet handed over to its client); `release` frees a kept slot then. A slot kept and
never released (its replica killed) is freed when its lease runs out, as an unsettled one is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence

from quotas.backends.journal import FallbackRow
from quotas.limits import Decision, ReservationRequest

# request ids -> the picodollars the ledger billed each (ids without a row are left out); the reaper asks
# it before returning an expired reservation, so a run whose row was written is billed, not refunded
Billed = Callable[[list[str]], Awaitable[dict[str, int]]]


class QuotaBackendError(Exception):
    """The backend could not be reached or answered in time (Redis down, timeout, no free connection)."""

    def __init__(self, message: str, *, transient: bool = False, back_pressure: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # a timeout, which a busy event loop alone can cause; not proof of an outage
        self.back_pressure = back_pressure  # every connection was busy for the whole wait: load, not an outage


# The most a counter (tokens per minute, a day's or a month's picodollars) is meant to hold: Redis' counters are int64
# (quotas/backends/shared.lua COUNTER_MAX, 4,096 below 2**63 to cover a double's rounding there); the in-process store
# keeps the same bound, so both refuse the same requests, for a reason of its own (`Decision.reason`): a scope without
# a limit reaches it too ($9.2M spent in a month), and no budget is spent nor rate limit reached.
COUNTER_MAX = 2**63 - 4096


class QuotaBackend(ABC):
    name = "base"
    num_replicas = 1  # gateway replicas sharing this backend, as far as it can tell

    @abstractmethod
    async def reserve(self, req: ReservationRequest) -> Decision:
        """Check every scope's limits and, if all pass, charge them all. A charge that would carry a counter past
        COUNTER_MAX is refused (reason `overflow_tpm`, `overflow_day` or `overflow_month`), nothing charged."""

    def settles_at_once(self) -> bool:
        """Whether `settle_now` does what `settle` does without ever suspending (an in-process store): a caller may
        then settle where it stands, with no task of its own."""
        return False

    def settle_now(self, req: ReservationRequest, *, tokens: int, money_pico: int, keep_slot: bool = False) -> None:
        """`settle` without an await, where `settles_at_once` says so."""
        raise NotImplementedError(f"{type(self).__name__} settles only with `await settle`")

    @abstractmethod
    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int, keep_slot: bool = False) -> None:
        """Replace the reservation's tokens and money by what was really used; free its concurrency slot unless
        `keep_slot` (then `release` frees it). Idempotent; where the store does not answer, retried in the background
        (the caller never waits)."""

    async def release(self, req: ReservationRequest) -> None:  # noqa: B027 (a backend without slots has none)
        """Free `req`'s concurrency slot in each of its scopes, settled or not: one kept past its settle
        (`keep_slot`), or one whose request ended before its settle ran. Idempotent: a slot already free (released,
        reaped, cancelled, taken over by a follow-on, its lease run out) is left as it is. Raises
        `QuotaBackendError` where the store does not answer."""

    def release_now(self, req: ReservationRequest) -> None:
        """`release` without an await, where `settles_at_once` says so."""
        raise NotImplementedError(f"{type(self).__name__} releases only with `await release`")

    def took_over(self, followed: ReservationRequest, req: ReservationRequest) -> bool:
        """Whether `req`, a follow-on of `followed` just admitted (no await since), took over its slot, as
        `ReservationRequest.follows` says a store does: yes, where one store holds both (a backend of two says where
        not: quotas/backends/failover.py)."""
        return True

    def row_refused(self, row: FallbackRow) -> None:  # noqa: B027 (only a backend that marks decisions has any)
        """The ledger refused the row of a request admitted with a `Decision.fallback` mark, the row that was to carry
        its money (`row.pico`) to the shared counters: the backend carries it itself, once."""

    async def reap(self, billed: Billed | None = None) -> int:
        """Return reservations whose lease ran out (money, tokens, slot), each once; the number returned."""
        return 0

    async def renew(self, reqs: Sequence[ReservationRequest]) -> None:  # noqa: B027 (no lease: nothing to renew)
        """Push the lease of these open reservations (and their concurrency slots) to `lease_s` from now: their
        requests still run on this live replica. One no longer held (settled, reaped, cancelled; a slot a follow-on
        took over) is left as it is: a renewal never brings anything back."""

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        """Picodollars each scope has spent (reservations included) on `now`'s day and month, in one read;
        None where this backend cannot tell. The router reads it to relax quality as budgets run low."""
        return None

    async def close(self) -> None:  # noqa: B027 (optional to override)
        """Release connections."""
