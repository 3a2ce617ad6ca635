"""Day rollups: a report process keeps the sums of closed UTC days, so a long report asked again reads little.

A report sums every row of its period (quotas/ledger_reads.py): 500k rows, seconds of CPU, each time it is asked.
Here a report process (quotas/report_worker.py) keeps, per ledger, tenant (or all tenants) and day, the sums a
report of that day reads: requests per (tenant, tier, key) and refusals per (tenant, key, reason). A report then
sums from rows only what is not kept (the days not closed yet, a period's partial first and last days) and checks
the kept days against the ledger with counts taken in its indexes, without reading or summing their rows. The
write path is unchanged: the ledger's commits keep nothing more, and the report process stays read-only.

When a day is closed. A row's `ts` is its request's arrival on its replica's clock (gateway/pipeline/context.py);
the row is written when the answer ends (a stream has no deadline, only `upstream_read_timeout_s` between chunks),
then committed by the group commit, whose writer keeps every row through a fault of the database for as long as
the fault lasts (quotas/ledger.py), as it keeps the refusals counted meanwhile; and replicas' clocks differ. So the
code bounds no row's lateness: a day's end plus a grace is a guess, and here it only decides what is worth keeping
(a day GRACE_S past its end rarely changes). Exactness rests on the check instead:

- `requests` rows are only inserted, never updated or deleted: a row added to a kept day adds to its count;
- refusal counts only grow (a late refusal adds to its minute's row, or inserts one), except the retention's
  pruning, which deletes every minute before a cut: it takes a range's earliest minute first;
- so each report reads, over the kept days' whole range, (request rows, refusals counted, earliest refusal
  minute): a COUNT over the (tenant, ts) index (on SQLite the index alone), SUM and MIN over (tenant, minute).
  Equal to what the kept days add up to, nothing was added there or pruned since (each day's marks can only grow
  but by pruning, so equal totals mean equal days). Unequal, the same counts per day name the days that changed,
  and only those are summed again. A kept day's marks are taken from its own sums (the same statements), so they
  always agree with them. What the marks cannot tell: a refusal count pruned and another added in the same range
  with the same total, which takes a refusal committed later than the retention (90 days by default).
- Sums are kept as the store gives them (ints, exact Decimals) and only added (EXACT: no rounding), so regrouping
  them gives the digits and decimal places of one sum of every row; refusals keep the SQL order within a day, and
  two days never tie on their first minute, so the reasons come in the order a full read gives.
- What is kept is keyed by the ledger's place and identity (`store_identity`: the SQLite file's inode, pinned by the
  open reader; the PostgreSQL database's OID): another database put at the same path or URL clears it.

Memory: counted in cells (a kept day's request groups plus refusal groups, at least 1), at most
MAX_CELLS_PER_SCOPE per ledger and tenant (its least recently used days go first) and MAX_CELLS in all (taken
from whichever tenant holds the most), so one tenant's reports cannot evict the others'.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from quotas.ledger_reads import NO_MARKS, LedgerReads, Marks
from quotas.ledger_rows import RefusalTotal, RequestTotals

DAY_S = 86400
GRACE_S = 3600.0  # a day is kept once this long past its end (how late rows come is unbounded: see above)
MAX_CELLS = 100_000  # ~0.6 KiB a cell (tests/quotas/test_report_rollups.py: under 1 KiB): ~60 MiB in all
MAX_CELLS_PER_SCOPE = 20_000  # one ledger and tenant (or all tenants); a day of 7 keys, 3 tiers, 4 reasons: ~50
FINE = ("day", "tenant", "tier", "key_id")  # what a kept day's requests are grouped by; reports regroup from it


@dataclass(eq=False)
class _Day:
    requests: list[RequestTotals]  # grouped by FINE
    refusals: list[RefusalTotal]  # in refusal_totals' order

    @property
    def marks(self) -> Marks:
        """Its Marks, from the sums themselves (read by the same statements: they agree with them)."""
        first = min((r.first_minute for r in self.refusals), default=None)
        return Marks(sum(t.requests for t in self.requests), sum(r.count for r in self.refusals), first)

    @property
    def cells(self) -> int:
        return max(1, len(self.requests) + len(self.refusals))


EMPTY = _Day([], [])  # a day with no rows (kept as a range of such days, not one by one)


@dataclass(eq=False)
class _Scope:
    """What is kept for one ledger (at one identity) and tenant."""

    identity: Hashable
    days: OrderedDict[int, _Day] = field(default_factory=OrderedDict)  # days with rows, least recently used first
    covered: list[list[int]] = field(default_factory=list)  # [first, end) ranges summed, apart; the rest of them: EMPTY
    cells: int = 0  # the days' cells, and one a range

    def get(self, day: int) -> _Day | None:
        found = self.days.get(day)
        if found is None:
            i = bisect.bisect_right(self.covered, [day, math.inf]) - 1
            if i >= 0 and self.covered[i][1] > day:
                return EMPTY
        return found

    def cover(self, first: int, end: int) -> int:
        """Mark [first, end) summed (next to or apart from the ranges there); returns the change in ranges."""
        before = len(self.covered)
        ranges = sorted([*self.covered, [first, end]])
        self.covered = [ranges[0]]
        for a, b in ranges[1:]:
            if a <= self.covered[-1][1]:
                self.covered[-1][1] = max(self.covered[-1][1], b)
            else:
                self.covered.append([a, b])
        return len(self.covered) - before

    def uncover_from(self, day: int) -> int:
        """No longer take the days from `day` to its range's end as summed; returns the change in ranges."""
        i = bisect.bisect_right(self.covered, [day, math.inf]) - 1
        if i < 0 or self.covered[i][1] <= day:
            return 0
        if self.covered[i][0] == day:
            del self.covered[i]
            return -1
        self.covered[i][1] = day
        return 0


class DayRollups:
    """Kept day sums, for one thread at a time (a report process answers one report at a time)."""

    def __init__(self, *, max_cells: int = MAX_CELLS, max_cells_per_scope: int = MAX_CELLS_PER_SCOPE,
                 grace_s: float = GRACE_S, clock: Callable[[], float] = time.time) -> None:
        self.max_cells = max_cells
        self.max_cells_per_scope = max_cells_per_scope
        self.grace_s = grace_s
        self.clock = clock
        self._scopes: dict[Hashable, _Scope] = {}
        self.cells = 0
        self.summed_days = 0  # closed days summed from their rows (not the open days, read at every report)
        self.reused_days = 0  # kept days a report used as they were

    def totals(self, reader: LedgerReads, place: Hashable, identity: Hashable, by: Sequence[str], *,
               tenant: str | None, since: float | None,
               until: float | None) -> tuple[list[RequestTotals], list[RefusalTotal]]:
        """What `reader.request_totals(by, …)` and `reader.refusal_totals(…)` give for the same query (the same sums;
        refusals in the same order), the closed days' from what is kept for the ledger at `place` (its
        `identity` as `store_identity` reads it)."""
        first, last = self._closed_days(reader, tenant, since, until)
        if first >= last:
            return (reader.request_totals(by, tenant=tenant, since=since, until=until),
                    reader.refusal_totals(tenant=tenant, since=since, until=until))
        days = self._days(reader, (place, tenant), identity, tenant, first, last)
        requests = reader.request_totals(by, tenant=tenant, since=since, until=first)
        refusals = reader.refusal_totals(tenant=tenant, since=since, until=first)
        index = [FINE.index(g) for g in by]
        for day in days:
            requests += [dataclasses.replace(t, group=tuple(t.group[i] for i in index)) for t in day.requests]
            refusals += day.refusals
        requests += reader.request_totals(by, tenant=tenant, since=last, until=until)
        refusals += reader.refusal_totals(tenant=tenant, since=last, until=until)
        return requests, refusals

    def _closed_days(self, reader: LedgerReads, tenant: str | None, since: float | None,
                     until: float | None) -> tuple[int, int]:
        """[first, last): the whole days inside [since, until) that ended GRACE_S ago, from the first with rows."""
        last = _day(self.clock() - self.grace_s)
        if until is not None:
            last = min(last, _day(until))
        earliest = reader.first_second(tenant=tenant)
        if earliest is None:
            return 0, 0
        first = _day(earliest)
        if since is not None:
            first = max(first, -(-math.ceil(since) // DAY_S) * DAY_S)
        return first, last

    def _days(self, reader: LedgerReads, key: Hashable, identity: Hashable, tenant: str | None, first: int,
              last: int) -> list[_Day]:
        scope = self._scopes.get(key)
        if scope is not None and scope.identity != identity:  # another database where this one was
            self._drop(key)
            scope = None
        if scope is None:
            scope = self._scopes[key] = _Scope(identity)
        wanted = range(first, last, DAY_S)
        days = {d: found for d in wanted if (found := scope.get(d)) is not None}
        reused = set(days)
        summed = _runs(d for d in wanted if d not in days)
        for a, b in summed:
            days.update(self._sum(reader, tenant, a, b))
        if reused:  # the kept days' marks, against the ledger's now: one count over the range, per day if unequal
            total = reader.marks(tenant=tenant, since=first, until=last, by_day=False).get(None, NO_MARKS)
            kept = _total(d.marks for d in days.values())
            requests, refusals = total.rows != kept.rows, total[1:] != kept[1:]
            if requests or refusals:  # per day, of the table that changed only
                now = reader.marks(tenant=tenant, since=first, until=last, by_day=True, requests=requests,
                                   refusals=refusals)

                def changed(d: int) -> bool:
                    was, ledger = days[d].marks, now.get(d, NO_MARKS)
                    return (requests and was.rows != ledger.rows) or (refusals and was[1:] != ledger[1:])

                for a, b in _runs(d for d in wanted if changed(d)):
                    days.update(self._sum(reader, tenant, a, b))
                    reused -= set(range(a, b, DAY_S))
                    summed.append((a, b))
            self.reused_days += len(reused)
        self._keep(key, scope, summed, [(d, days[d]) for d in wanted if days[d] is not EMPTY])
        return [days[d] for d in wanted]

    def _sum(self, reader: LedgerReads, tenant: str | None, first: int, last: int) -> dict[int, _Day]:
        """The days [first, last) summed from their rows."""
        days: dict[int, _Day] = {}
        for t in reader.request_totals(FINE, tenant=tenant, since=first, until=last):
            days.setdefault(int(t.group[0]), _Day([], [])).requests.append(t)
        for r in reader.refusal_totals(tenant=tenant, since=first, until=last):
            days.setdefault(r.day, _Day([], [])).refusals.append(r)
        self.summed_days += (last - first) // DAY_S
        return {d: days.get(d, EMPTY) for d in range(first, last, DAY_S)}

    def _keep(self, key: Hashable, scope: _Scope, summed: list[tuple[int, int]], days: list[tuple[int, _Day]]) -> None:
        """Keep a report's days: those it summed as ranges, those with rows (summed or not) as its most recent."""
        for a, b in summed:
            for d in range(a, b, DAY_S):  # summed again: what was kept of them goes
                if (old := scope.days.pop(d, None)) is not None:
                    self._count(scope, -old.cells)
            self._count(scope, scope.cover(a, b))
        for d, entry in days:
            old = scope.days.pop(d, None)
            if old is not None and old is not entry:
                self._count(scope, -old.cells)
            if entry.cells > self.max_cells_per_scope:  # not kept: summed again next time
                self._count(scope, scope.uncover_from(d))
                continue
            scope.days[d] = entry
            if old is not entry:
                self._count(scope, entry.cells)
        while scope.cells > self.max_cells_per_scope:
            self._evict(key)
        while self.cells > self.max_cells:
            self._evict(max(self._scopes, key=lambda k: self._scopes[k].cells))
        if key in self._scopes and not scope.days and not scope.covered:
            del self._scopes[key]

    def _count(self, scope: _Scope, cells: int) -> None:
        scope.cells += cells
        self.cells += cells

    def _evict(self, key: Hashable) -> None:
        """The scope's least recently used day goes (and what its range kept after it, of days with no rows)."""
        scope = self._scopes[key]
        if not scope.days:
            self._drop(key)
            return
        day, entry = scope.days.popitem(last=False)
        self._count(scope, scope.uncover_from(day) - entry.cells)

    def _drop(self, key: Hashable) -> None:
        scope = self._scopes.pop(key)
        self.cells -= scope.cells

    def cells_of(self, place: Hashable, tenant: str | None) -> int:
        scope = self._scopes.get((place, tenant))
        return scope.cells if scope is not None else 0


def _day(t: float) -> int:
    """The first second of the UTC day of `t` (as the reads' `_day_start` of its whole second)."""
    return math.floor(t) // DAY_S * DAY_S


def _runs(days: Iterable[int]) -> list[tuple[int, int]]:
    """Consecutive days (ascending) as [first, end) ranges."""
    runs: list[list[int]] = []
    for d in days:
        if runs and runs[-1][1] == d:
            runs[-1][1] = d + DAY_S
        else:
            runs.append([d, d + DAY_S])
    return [(a, b) for a, b in runs]


def _total(marks: Iterable[Marks]) -> Marks:
    rows = refused = 0
    first: int | None = None
    for m in marks:
        rows, refused = rows + m.rows, refused + m.refused
        if m.first_minute is not None and (first is None or m.first_minute < first):
            first = m.first_minute
    return Marks(rows, refused, first)
