"""What the gateway does when Redis fails: fail open within a local safety limit, or fail closed.

`open`: reservations go to an in-process memory backend until Redis answers again. `closed`: reservations
raise, and the gateway answers 503. Each change of state is logged once and counted; Redis is tried again
at most once a second, so a dead Redis does not add its timeout to every request.

An outage does not reset budgets. Every answer from Redis carries each scope's spend and Redis' clock; the
fallback starts from those last known figures (raised to the ledger's totals where a `ledger_spend` source
is given, which covers tenants this replica never saw), dates its money as Redis does (by the request's arrival,
bounded by Redis' clock as last seen; one without an arrival by that clock), and takes only its share (1/N, N the
live replicas) of what was left of each budget, so N replicas failing open together do not spend N budgets. Rate,
token and concurrency limits apply per replica, as before. What it settles locally goes into an outage journal,
added to Redis exactly once when Redis answers again; where Redis came back empty, before the primary re-seeds a
tenant's counters from the ledger (RedisBackend `before_reseed`), whose totals already hold that money.

Given the ledger's rows (`rows`), the journal does not depend on this process living: a reservation the fallback
admits carries a mark (`Decision.fallback`) that its ledger row is written with, and the marked rows, not this
process's memory, are what reaches Redis (quotas/backends/journal.py): every flush (a reaper round, Redis back, a
settle, before a re-seed) applies the rows no replica has applied, this one's or a dead one's, each once. A row
applied whose note in the ledger was lost (a crash in between) is applied again as a no-op: its marker in Redis
outlives that window (JOURNAL_TTL_S, a by-id row's too: settle.lua sets it with the settle). Where Redis
lost its data, a re-seed raises counters to the ledger's totals, which hold the marked rows: the flush before it
applies those pending then, and a row written between that flush and the re-seed's read, or whose apply failed
then, is counted twice on that tenant's day and month (an early refusal, never overspend), bounded by the money
settled on fallbacks in that window and by the markers lost with Redis' data. A marked row the ledger refuses
(`row_refused`) carries nothing: its money goes into this process's journal as that row, applied under its id.

A refused connection means Redis is down at once. A timeout alone does not (a busy event loop can cause
one): the request gets a retryable 503, and Redis is down only once a streak of failures with no success in
between (from a reserve or a reaper round) holds `down_after_tries` tries one after another and has lasted
`down_after_s`, so a burst of load never quietly turns shared limits into per-replica ones. Tries that run
alongside each other count as one (a burst times out together); a success ends the streak (failures with
answers in between are blips, and a quiet replica's two failed reserves a minute apart leave Redis up). The
spacing of the tries does not end it: a hung Redis, which accepts connections and never answers, is down for
a lone client retrying once a second at its `down_after_tries`-th failed try, as for a busy replica, instead
of answering it retryable 503s for as long as Redis hangs.
Waiting in vain for a free connection never does: that is back-pressure (a retryable 503), not an outage. Nor does
an error a script raised itself (`QuotaScriptError`: one tenant's counter it cannot add to, a bug): Redis answered,
so that request fails (a retryable 503) and every other goes on sharing Redis' limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, Literal

from quotas.backends.base import Billed, QuotaBackend, QuotaBackendError
from quotas.backends.journal import FallbackRow, FallbackRows, OutageJournal, fallback_mark
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.backends.redis_errors import QuotaScriptError
from quotas.fault_log import FaultLog
from quotas.limits import Decision, ReservationRequest, ScopeLimits, Spend, dating_instant, utc_dates

log = logging.getLogger("tiergate.quotas")
RETRY_EVERY_S = 1.0
DOWN_AFTER_S = 1.0  # timeouts with no success in between for this long ...
DOWN_AFTER_TRIES = 3  # ... and over this many tries one after another mean Redis is down
SEED_WAIT_S = 2.0  # a local reservation waits this long at most for the ledger's totals at an outage's start
ROWS_PER_FLUSH = 500  # fallback rows read from the ledger, and sent to Redis per tenant, at a time

# the ledger's spend per (tenant, scope) on the day and month of a time (epoch seconds)
LedgerSpend = Callable[[float], Awaitable[dict[tuple[str, str], Spend]]]


class FailoverBackend(QuotaBackend):
    name = "failover"

    def __init__(self, primary: RedisBackend, *, mode: Literal["open", "closed"] = "open",
                 on_state: Callable[[bool], None] | None = None, ledger_spend: LedgerSpend | None = None,
                 down_after_s: float = DOWN_AFTER_S, down_after_tries: int = DOWN_AFTER_TRIES,
                 retry_every_s: float = RETRY_EVERY_S, rows: FallbackRows | None = None) -> None:
        self.primary = primary
        self.local = MemoryBackend(max_dating_lag_s=primary.max_dating_lag_s)
        self.mode = mode
        self.up = True
        self.journal = OutageJournal()
        self.down_after_s = down_after_s
        self.down_after_tries = down_after_tries
        self.retry_every_s = retry_every_s
        self.num_local_reservations = 0  # admitted by the fallback
        self.num_journal_batches = 0  # outage-journal batches Redis applied
        self.num_journal_requests = 0  # ...and requests applied by their id
        self.num_journal_rows = 0  # rows settled on a fallback (any replica's, or refused by the ledger) it applied
        self._rows = rows
        self._on_state = on_state
        self._ledger_spend = ledger_spend
        self._retry_at = 0.0
        self._failing_since: float | None = None  # the streak's first failure; None while Redis answers
        self._failed_at = 0.0  # the streak's last counted failure
        self._num_failed_tries = 0  # failed tries in the streak, one after another
        # reservations held by the fallback, as it holds them, whether their reserve was sent to Redis, and whether
        # their ledger row is to carry their money there (a `fallback_mark`)
        self._local: dict[str, tuple[ReservationRequest, bool, bool]] = {}
        # the fallback's reservations settled with their slot kept (`keep_slot`), as it holds them, until `release`
        self._local_slots: dict[str, ReservationRequest] = {}
        self._known: dict[tuple[str, str], Spend] = {}  # (tenant, scope) -> what Redis last said it spent
        self._clock_offset_s = 0.0  # Redis' clock minus ours, as last seen
        self._outage_base: dict[tuple[str, str, str, str], tuple[int, int]] = {}  # spend as this outage began
        self._seeding: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        # in the log once per fault, then one line when it works again: a flush after each local settle, a ledger
        # read at each outage's start (a flapping Redis begins many)
        self._flush_faults = FaultLog(log, "applying the quota fallback's outage journal to Redis (retried later)",
                                      level=logging.INFO, rounds="flushes")
        self._seed_faults = FaultLog(log, "reading the ledger's spend for the quota fallback (the last figures from "
                                          "Redis hold)", rounds="reads")
        primary.before_reseed = self.flush_journal  # a Redis that lost its data: the journal before the ledger read

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self.primary.num_replicas

    def _mark(self, up: bool, why: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log.warning("quota backend %s is back; shared limits resume", self.primary.name)
            self._spawn(self.flush_journal())
        else:
            log.error("quota backend %s failed (%s); failing %s", self.primary.name, why, self.mode)
            self._begin_outage()
        if self._on_state:
            self._on_state(up)

    async def reserve(self, req: ReservationRequest) -> Decision:
        sent = False
        began = time.monotonic()
        if self.up or began >= self._retry_at:
            try:
                decision = await self.primary.reserve(req)
            except QuotaScriptError:  # Redis answered, with this request's own failure: up, for everyone else
                self._failing_since = None
                self._mark(True)
                raise
            except QuotaBackendError as exc:
                if exc.back_pressure:  # every connection busy: wait-and-retry for the client, not an outage
                    raise
                sent = True
                now = time.monotonic()
                self._failed(began, now)
                if self.up and exc.transient and not self._streak_is_outage(now):
                    raise
                self._retry_at = now + self.retry_every_s
                self._mark(False, str(exc))
            else:
                self._observe(req.tenant, decision)
                self._failing_since = None
                self._mark(True)
                return decision
        if self.mode == "closed":
            raise QuotaBackendError(f"{self.primary.name} is unavailable and the gateway fails closed")
        return await self._reserve_locally(req, sent)

    def _failed(self, began: float, now: float) -> None:
        """Count a reserve begun at `began` that failed at `now` in the streak since Redis last answered: a new
        try if it began after the streak's last counted failure; one that ran alongside it adds nothing."""
        if self._failing_since is None:
            self._failing_since, self._num_failed_tries = now, 0
        elif began < self._failed_at:
            return
        self._failed_at = now
        self._num_failed_tries += 1

    def _streak_is_outage(self, now: float) -> bool:
        return (self._failing_since is not None and self._num_failed_tries >= self.down_after_tries
                and now - self._failing_since >= self.down_after_s)

    def _observe(self, tenant: str, decision: Decision) -> None:
        if decision.clock_s is not None:
            self._clock_offset_s = decision.clock_s - time.time()
        for scope, spend in decision.spent.items():
            self._known[tenant, scope] = spend

    def _begin_outage(self) -> None:
        """Start the fallback from the last known spend (never lower than what it counted itself)."""
        self._outage_base.clear()
        if self.mode == "closed":  # no fallback to start
            return
        for (tenant, scope), s in self._known.items():
            self.local.seed_spend(tenant, scope, day=s.day, month=s.month, day_pico=s.day_pico,
                                  month_pico=s.month_pico)
        if self._ledger_spend is not None:
            self._seeding = asyncio.get_running_loop().create_task(self._seed_from_ledger())

    async def _seed_from_ledger(self) -> None:
        try:
            totals = await self._ledger_spend(time.time() + self._clock_offset_s)  # type: ignore[misc]
        except Exception as exc:  # the last figures from Redis still hold; the outage must not fail on the ledger
            self._seed_faults.failed(exc)
            return
        self._seed_faults.ok()
        for (tenant, scope), s in totals.items():
            self.local.seed_spend(tenant, scope, day=s.day, month=s.month, day_pico=s.day_pico,
                                  month_pico=s.month_pico)

    async def _reserve_locally(self, req: ReservationRequest, sent: bool) -> Decision:
        if self._seeding is not None and not self._seeding.done():
            await asyncio.wait({self._seeding}, timeout=SEED_WAIT_S)
        # dated as Redis would date it: by its arrival moved into [Redis' now - lag, Redis' now], Redis' now being
        # Redis' clock as last seen (ours plus the offset). The arrival itself is not shifted: Redis gets it as this
        # gateway's clock reads it, as its ledger row has it, and a clock off by more than the lag is clamped anyway
        now = req.now + self._clock_offset_s
        local = replace(req, now=now, dated_at=None if req.dated_at is None else dating_instant(
            req.dated_at, now, self.primary.max_dating_lag_s))
        local = replace(local, scopes=tuple(self._share(local, lim) for lim in local.scopes))
        decision = await self.local.reserve(local)
        if decision.admitted:
            marked = False
            if self._rows is not None:
                try:
                    decision, marked = replace(decision, fallback=fallback_mark(local, sent)), True
                except ValueError as exc:  # its money goes into this process's journal at its settle
                    log.warning("request %s settles without a fallback mark: %s", req.request_id, exc)
            self._local[req.request_id] = (local, sent, marked)
            self.num_local_reservations += 1
        return decision

    def _share(self, req: ReservationRequest, lim: ScopeLimits) -> ScopeLimits:
        """This replica's budgets for the outage: what was spent as it began plus 1/N of what was left."""
        if lim.budget_day_pico is None and lim.budget_month_pico is None:
            return lim
        key = (req.tenant, lim.scope, req.day, req.month)
        if key not in self._outage_base:
            self._outage_base[key] = self.local.spend_of(req.tenant, lim.scope, req.day, req.month)
        base_day, base_month = self._outage_base[key]
        n = max(1, self.num_replicas)

        def share(limit: int | None, spent: int) -> int | None:
            return None if limit is None else spent + max(0, limit - spent) // n

        return replace(lim, budget_day_pico=share(lim.budget_day_pico, base_day),
                       budget_month_pico=share(lim.budget_month_pico, base_month))

    async def settle(self, req: ReservationRequest, *, tokens: int, money_pico: int, keep_slot: bool = False) -> None:
        held = self._local.pop(req.request_id, None)
        if held is None:  # a reservation Redis holds: its backend retries until Redis answers
            await self.primary.settle(req, tokens=tokens, money_pico=money_pico, keep_slot=keep_slot)
            return
        local, sent, marked = held
        if keep_slot and self.local.holds_slot(local):  # (not one released before its settle)
            self._local_slots[req.request_id] = local
        await self.local.settle(local, tokens=tokens, money_pico=money_pico, keep_slot=keep_slot)
        if marked and money_pico:
            pass  # its ledger row, durable before this settle, carries its money (`_flush_rows`)
        elif sent:  # Redis may hold a reservation for it as well: applied by its id (at 0 too: a refund there)
            self.journal.add_request(local, money_pico)
        else:
            self.journal.add(local.tenant, tuple(lim.scope for lim in local.scopes), local.day, local.month,
                             money_pico)
        if self.up:
            self._spawn(self.flush_journal())

    async def release(self, req: ReservationRequest) -> None:
        """The slot where its reservation was held: the fallback's (settled or not), else Redis'."""
        local = self._held_here(req.request_id)
        self._local_slots.pop(req.request_id, None)
        if local is not None:
            self.local.release_now(local)
        else:
            await self.primary.release(req)

    def took_over(self, followed: ReservationRequest, req: ReservationRequest) -> bool:
        """Whether `req`, a follow-on of `followed` this backend has just admitted (no await since), took over its
        slot (`ReservationRequest.follows`): where one store holds both, the fallback (which then forgets the slot
        it kept for `followed`) or Redis. A store never takes over the other's slot: `req` admitted on the fallback
        while Redis holds `followed`'s slot (or on Redis while the fallback holds it) took one of its own, and
        `followed`'s is still to be released where it is held (quotas/reservations.py `_taken_over`)."""
        if (self._held_here(followed.request_id) is not None) != (req.request_id in self._local):
            return False
        self._local_slots.pop(followed.request_id, None)
        return True

    def _held_here(self, request_id: str) -> ReservationRequest | None:
        """The fallback's reservation (as it holds it), open or settled with its slot kept; None: Redis holds it."""
        held = self._local.get(request_id)
        return held[0] if held is not None else self._local_slots.get(request_id)

    async def flush_journal(self) -> None:
        """Add what was settled locally to Redis, each batch once; raises if Redis does not answer (what is
        left waits for the next flush: on recovery, after a local settle, at every reaper round)."""
        async with self._flushing:
            # until nothing is left: a tenant's sums settled while its batch was in flight make a batch of their
            # own once that one is applied (one pass would leave them for a flush that may never come)
            while len(self.journal):
                if refused := self.journal.rows():
                    await self._apply(refused)
                    self.journal.rows_applied([row.request_id for row in refused])
                for req, pico in self.journal.requests():
                    await self.primary.settle_elsewhere(req, money_pico=pico)
                    self.journal.request_applied(req.request_id)
                    self.num_journal_requests += 1
                for tenant, batch_id, entries in self.journal.batches():
                    if await self.primary.apply_journal(batch_id, tenant, entries):
                        self.num_journal_batches += 1
                    self.journal.applied(tenant, batch_id)
            if self._rows is not None:
                await self._flush_rows(self._rows)

    async def _flush_rows(self, rows: FallbackRows) -> None:
        """Apply the ledger's rows settled on any replica's fallback that Redis' counters do not have, then note
        them applied. Each row is applied under its own id (journal_rows.lua; a by-id row as a settle of its id), so
        replicas doing this at once, or a repeat after a crash before the note, add each row's money once."""
        while batch := await rows.pending(ROWS_PER_FLUSH):
            await self._apply(batch)
            await rows.applied([row.request_id for row in batch])

    async def _apply(self, rows: Sequence[FallbackRow]) -> None:
        """Each row's money to Redis' counters under its request id: a row applied before, by any replica, adds
        nothing."""
        by_tenant: dict[str, list[FallbackRow]] = {}
        for row in rows:
            if row.by_id:
                self.num_journal_rows += await self.primary.settle_row_elsewhere(row)
            else:
                by_tenant.setdefault(row.tenant, []).append(row)
        for tenant, tenant_rows in by_tenant.items():
            self.num_journal_rows += await self.primary.apply_rows(tenant, tenant_rows)

    def row_refused(self, row: FallbackRow) -> None:
        """Its money goes into the journal as the refused row (at 0 its settle has journaled it already)."""
        if not row.pico:
            return
        self.journal.add_row(row)
        if self.up:
            self._spawn(self.flush_journal())

    async def reap(self, billed: Billed | None = None) -> int:
        """Return the fallback's expired reservations (billed ones are journaled), then Redis' (see
        `RedisBackend.reap`), and apply the outage journal."""
        now = time.time() + self._clock_offset_s
        ids = [rid for rid in self.local.expired(now) if rid in self._local]
        amounts = await billed(ids) if ids and billed is not None else {}
        returned = 0
        for rid, pico in amounts.items():
            if (held := self._local.get(rid)) is not None:
                await self.settle(held[0], tokens=0, money_pico=pico)
                returned += 1
        returned += await self.local.reap(None, now=now)
        if self.up or time.monotonic() >= self._retry_at:
            returned += await self.primary.reap(billed)
            self._failing_since = None  # Redis answered: failures before this were blips
            await self.flush_journal()
        return returned

    async def renew(self, reqs: Sequence[ReservationRequest]) -> None:
        """The fallback's reservations as it holds them, on Redis' clock as last seen; Redis' while it is up (or due
        a try, as `reap`: a lease Redis holds runs out only where Redis' reaper runs)."""
        held = [(r, self._held_here(r.request_id)) for r in reqs]
        local = [mine for _, mine in held if mine is not None]
        if local:
            self.local.renew_now(local, now=time.time() + self._clock_offset_s)
        shared = [r for r, mine in held if mine is None]
        if shared and (self.up or time.monotonic() >= self._retry_at):
            await self.primary.renew(shared)

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        """The primary's figures while it answers; while it is down, the local ones (from the last known). When
        the primary fails to answer while up, the spend its last reserve for the tenant answered (raises only
        where a scope has none): routing by budget goes on from a figure a moment old rather than none."""
        if self.up:
            try:
                return await self.primary.spent(tenant, scopes, now)
            except QuotaBackendError:
                known = self._last_spent(tenant, scopes, now)
                if known is None:
                    raise
                return known
        return await self.local.spent(tenant, scopes, now + self._clock_offset_s)

    def _last_spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        """Each scope's last known spend on the day and month of `now` as Redis dates it (none yet on a day or
        month after the one it was known for); None if a scope has no figure."""
        day, month = utc_dates(int((now + self._clock_offset_s) // 86400))
        out = {}
        for scope in scopes:
            s = self._known.get((tenant, scope))
            if s is None:
                return None
            out[scope] = (s.day_pico if s.day == day else 0, s.month_pico if s.month == month else 0)
        return out

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._flush_faults.failed(exc)
        elif not task.cancelled():
            self._flush_faults.ok()

    async def close(self) -> None:
        if len(self.journal):
            with contextlib.suppress(QuotaBackendError, TimeoutError):  # what is left is logged below
                await asyncio.wait_for(self.flush_journal(), timeout=2.0)
        if len(self.journal):
            log.error("closing with outage spend not yet in Redis: %d tenants and requests", len(self.journal))
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        await self.primary.close()
