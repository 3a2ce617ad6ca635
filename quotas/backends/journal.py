"""The outage journal: money a replica settled on its local fallback while Redis was down, to be added to
Redis exactly once when it is back.

Requests never sent to Redis are summed per tenant, scope, day and month as they come. To apply them, a
tenant's sums are sealed into a batch with an id of its own; the batch is sent (journal.lua) until Redis
answers, always with the same id and the same entries, and Redis applies an id once, so an answer lost on
the way back never adds the money twice. What is settled while a batch is in flight waits for the next one.

A request whose reserve was sent to Redis without an answer (the failure that made the replica fail open)
may hold a reservation there too, which the reaper would bill from the ledger or refund. Each of those is
kept by its id and applied as a settle of that id (`RedisBackend.settle_elsewhere`), which replaces what
Redis holds for it, or adds the money if it holds nothing, exactly once.

The journal dies with its process; the ledger does not. Where the failover is given the ledger's rows
(`FallbackRows`), each row settled on the fallback carries a mark (`fallback_mark`: the day, month and scopes its
money counted for, and whether Redis may hold its reserve), written in the row's own commit, and the rows are the
journal: any replica applies the marked rows no replica has applied yet, each row under a marker of its own in
Redis (its request id), then notes them applied in the ledger. A replica killed with money not yet in Redis leaves
its rows to the next replica's reaper round, and two replicas applying the same rows apply them once. A row the
ledger refused carries nothing: the journal keeps it (`add_row`), to be applied as the ledger's would have been,
under its request id, so a row the ledger did keep after all (a commit whose answer was lost) counts once.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from quotas.limits import ReservationRequest

Entry = tuple[str, str, str, int]  # scope, day (YYYYMMDD), month (YYYYMM), picodollars


@dataclass(frozen=True)
class FallbackRow:
    """A ledger row settled on a fallback, as Redis' counters are to have it."""

    request_id: str
    tenant: str
    scopes: tuple[str, ...]
    day: str  # YYYYMMDD
    month: str  # YYYYMM
    pico: int  # the row's price
    by_id: bool  # Redis may hold a reservation for it: applied as a settle of its id


class FallbackRows(Protocol):
    """The ledger's rows settled on a fallback whose money Redis' counters do not have yet."""

    async def pending(self, limit: int) -> list[FallbackRow]:
        """At most `limit` of them, oldest first."""

    async def applied(self, request_ids: Sequence[str]) -> None:
        """Note that Redis' counters have them (a repeat changes nothing)."""


def fallback_mark(req: ReservationRequest, sent: bool) -> str:
    """What a row settled on the fallback keeps of `req` (as the fallback dated it): "sum" or "id" (its reserve was
    sent to Redis), its day, and its scopes, joined by commas. A scope may hold colons (a key's, "k:<key id>": the
    kind and the day are split off before them); one with a comma would come back as two, so it is refused
    (ValueError): the caller settles that request without a mark."""
    scopes = [lim.scope for lim in req.scopes]
    if odd := [scope for scope in scopes if "," in scope]:
        raise ValueError(f"a fallback mark cannot hold the scope {odd[0]!r}: commas separate its scopes")
    return f"{'id' if sent else 'sum'}:{req.day}:{','.join(scopes)}"


def fallback_row(request_id: str, tenant: str, pico: int, mark: str) -> FallbackRow:
    kind, day, scopes = mark.split(":", 2)
    return FallbackRow(request_id, tenant, tuple(scopes.split(",")), day, day[:6], pico, kind == "id")


class OutageJournal:
    def __init__(self) -> None:
        self._id = uuid.uuid4().hex[:16]
        self._seq = itertools.count(1)
        self._pending: dict[str, dict[tuple[str, str, str], int]] = {}  # tenant -> (scope, day, month) -> pico
        self._sealed: dict[str, tuple[str, list[Entry]]] = {}  # tenant -> (batch id, entries) being applied
        self._by_id: dict[str, tuple[ReservationRequest, int]] = {}  # request id -> (request, picodollars)
        self._rows: dict[str, FallbackRow] = {}  # request id -> a marked row the ledger refused

    def add(self, tenant: str, scopes: tuple[str, ...], day: str, month: str, pico: int) -> None:
        if pico == 0:
            return
        sums = self._pending.setdefault(tenant, {})
        for scope in scopes:
            sums[scope, day, month] = sums.get((scope, day, month), 0) + pico

    def add_request(self, req: ReservationRequest, pico: int) -> None:
        """A request Redis may also hold a reservation for: applied by its id, even at 0 (a refund there)."""
        self._by_id[req.request_id] = (req, pico)

    def requests(self) -> list[tuple[ReservationRequest, int]]:
        return list(self._by_id.values())

    def request_applied(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def add_row(self, row: FallbackRow) -> None:
        """A row settled on the fallback that the ledger refused: applied as a ledger row (its id's marker)."""
        self._rows[row.request_id] = row

    def rows(self) -> list[FallbackRow]:
        return list(self._rows.values())

    def rows_applied(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._rows.pop(rid, None)

    def batches(self) -> list[tuple[str, str, list[Entry]]]:
        """(tenant, batch id, entries) to apply: the batches sealed before and not yet applied, and a new one
        for each tenant with pending entries and no batch in flight."""
        for tenant in [t for t in self._pending if t not in self._sealed]:
            sums = self._pending.pop(tenant)
            self._sealed[tenant] = (f"{self._id}-{next(self._seq)}", [(*k, v) for k, v in sums.items()])
        return [(tenant, batch_id, entries) for tenant, (batch_id, entries) in self._sealed.items()]

    def applied(self, tenant: str, batch_id: str) -> None:
        if self._sealed.get(tenant, ("",))[0] == batch_id:
            del self._sealed[tenant]

    def __len__(self) -> int:
        """Tenants with sums, and requests and rows, not yet in Redis."""
        return len(self._pending.keys() | self._sealed.keys()) + len(self._by_id) + len(self._rows)
