"""The quota backend boundary.

What crosses it: a `ReservationRequest` (who, which scopes with which limits, how many tokens and
picodollars to reserve) goes in; a `Decision` comes out. `settle` later replaces the reservation by the
real usage. Every implementation is atomic per request: all scopes' limits are checked and charged
together, or nothing is charged at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from quotas.limits import Decision, ReservationRequest


class QuotaBackendError(Exception):
    """The backend could not be reached or answered in time (Redis down, timeout)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # a timeout, which a busy event loop alone can cause; not proof of an outage


class QuotaBackend(ABC):
    name = "base"

    @abstractmethod
    async def reserve(self, req: ReservationRequest) -> Decision:
        """Check every scope's limits and, if all pass, charge them all."""

    @abstractmethod
    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int) -> None:
        """Replace the reservation's tokens and money by what was really used; free its concurrency slot."""

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        """Picodollars each scope has spent (reservations included) on `now`'s day and month, in one read;
        None where this backend cannot tell. The router reads it to relax quality as budgets run low."""
        return None

    async def close(self) -> None:  # noqa: B027 (optional to override)
        """Release connections."""
