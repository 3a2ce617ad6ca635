"""How Redis' counters catch up with money counted elsewhere: the part of `RedisBackend` (quotas/backends/redis.py)
that applies the failover's outage journal and re-seeds a tenant whose counters Redis lost.

The outage journal. Money a replica settled on its local fallback while Redis was down (quotas/backends/failover.py)
reaches the counters exactly once: as batches of sums (journal.lua: one marker per batch id), as ledger rows
(journal_rows.lua: one marker per request id, kept JOURNAL_TTL_S) or, for a request whose reserve Redis may hold, as
a settle of its id (settle.lua, which sets the row's marker too: a repeat is a no-op for JOURNAL_TTL_S).

Re-seeding. A Redis that lost its data (restarted without persistence, failed over to a lagging replica, FLUSHALL)
must not reset every budget. Given a `tenant_spend` source, each tenant has a seeded sentinel (`<tag>:seeded`, no
TTL, in the tenant's slot, so a lost shard of a cluster is seen per tenant). A reserve that finds it missing charges
nothing (reserve.lua answers 2); the backend reads that tenant's ledger totals for Redis' day and month (by the
ledger's (tenant, ts) index: a new tenant's first request reads its own rows, none, not everyone's; one read per
tenant at a time in a process, shared by its reserves, `_reseed`), raises the tenant's day and month counters of
every scope to at least the ledger's totals (reseed.lua: max(held, total), so re-seeds racing each other, from
other replicas too, or racing normal spend never double or lower a counter), sets the sentinel, then reserves
again. Before the read, the failover's outage journal (money settled on its fallback, already in the ledger) is
applied (`before_reseed`), so max() counts that money once. Rows reach the ledger before their settle
(gateway/pipeline/settle.py), so a settle that finds its record gone (settle.lua's "not held" path) before the
ledger is read bills money the ledger's total already has, and max() counts it once; one after the read bills it
again: an overcount (refusing early, never spending twice) bounded by the tenant's reservations in flight when the
data was lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from quotas.backends.base import QuotaBackendError
from quotas.backends.journal import FallbackRow
from quotas.limits import Spend

log = logging.getLogger("tiergate.quotas")

# one tenant's spend per scope on the day and month of a time (epoch seconds), from the ledger
TenantSpend = Callable[[str, float], Awaitable[dict[str, Spend]]]

JOURNAL_TTL_S = 7 * 86_400  # an applied outage-journal batch, or row, is remembered this long
RESEED_LOG_EVERY_S = 60.0  # a loss of Redis' counters is logged at most this often


class RedisRecovery:
    """Mixed into `RedisBackend`, whose key names (`tag`, `base`, `seeded_key`), scripts (`_run`) and settles
    (`_finish_id`) it uses."""

    tag: Callable[[str], str]
    base: Callable[[str, str], str]
    seeded_key: Callable[[str], str]
    _run: Callable[[str, list[str], list[Any]], Awaitable[Any]]
    _finish_id: Callable[..., Awaitable[int]]

    def __init__(self, tenant_spend: TenantSpend | None) -> None:
        self._tenant_spend = tenant_spend  # None: Redis' counters are trusted as they are (no sentinel checked)
        self._reseeding: dict[str, asyncio.Task[None]] = {}  # per tenant, the re-seed under way in this process
        self.num_reseeds = 0  # tenants re-seeded from the ledger (a new tenant's first reserve counts too)
        self.num_reseeds_raised = 0  # ...of which the ledger had spend for: Redis had lost what it held
        self._reseed_logged_at = -math.inf  # monotonic: a loss is logged once a minute, not once per tenant
        self._reseeds_unlogged = 0
        # run before the ledger is read for a re-seed: the failover's outage journal (money the ledger has, settled
        # on its fallback) goes in first, so the re-seed's max() counts it once rather than the journal adding it
        # again on top of the ledger's total
        self.before_reseed: Callable[[], Awaitable[None]] | None = None

    # ---- the outage journal ----

    async def apply_journal(self, batch_id: str, tenant: str, entries: Sequence[tuple[str, str, str, int]]) -> bool:
        """Add (scope, day, month, picodollars) entries settled elsewhere to the tenant's counters, once per
        `batch_id`; False if that batch was applied before."""
        args: list[int | str] = [JOURNAL_TTL_S]
        for scope, day, month, pico in entries:
            args += [self.base(tenant, scope), day, month, pico]
        return bool(await self._run("journal", [f"{self.tag(tenant)}:jnl:{batch_id}"], args))

    async def apply_rows(self, tenant: str, rows: Sequence[FallbackRow]) -> int:
        """Add the money of one tenant's ledger rows settled on a fallback (each on its day and month, to its
        scopes) to the counters, each row once whoever sends it (journal_rows.lua: a marker per request id, kept
        JOURNAL_TTL_S); how many were applied now."""
        keys: list[str] = []
        args: list[int | str] = [JOURNAL_TTL_S]
        for row in rows:
            keys.append(f"{self.tag(tenant)}:jrow:{row.request_id}")
            args += [len(row.scopes), row.day, row.month, row.pico, *(self.base(tenant, s) for s in row.scopes)]
        return int(await self._run("journal_rows", keys, args))

    async def settle_row_elsewhere(self, row: FallbackRow) -> bool:
        """`settle_elsewhere` for a ledger row settled on a fallback whose reserve Redis may hold: by its id, with its
        marker (as `apply_rows`', kept JOURNAL_TTL_S, set in the same script), so a repeat changes nothing however
        late it comes (its note "applied" failed; a crash before the note, restarted after the settle's tombstone
        expired, 15 minutes); False then."""
        return await self._finish_id(row.tenant, row.request_id, 0, row.pico, "settle",
                                     [self.base(row.tenant, s) for s in row.scopes], row.day, row.month,
                                     marker=f"{self.tag(row.tenant)}:jrow:{row.request_id}") != 0

    # ---- re-seeding from the ledger ----

    async def _reseed(self, tenant: str, now: float) -> None:
        """Raise `tenant`'s money counters to the ledger's totals on `now`'s (Redis' clock) day and month and mark
        it seeded: one ledger read per tenant at a time, shared by this process's reserves (a reserve that leaves
        does not stop it)."""
        task = self._reseeding.get(tenant)
        if task is None or task.done():
            task = self._reseeding[tenant] = asyncio.get_running_loop().create_task(self._reseed_one(tenant, now))
            task.add_done_callback(lambda t: self._reseeding.pop(tenant, None) if self._reseeding.get(tenant) is t
                                   else None)
        try:
            await asyncio.shield(task)
        except QuotaBackendError:  # Redis failed while re-seeding
            raise
        except Exception as exc:  # the ledger could not be read: retryable, nothing was charged
            raise QuotaBackendError(f"redis: re-seeding from the ledger failed ({exc})", transient=True) from exc

    async def _reseed_one(self, tenant: str, now: float) -> None:
        if self.before_reseed is not None:
            await self.before_reseed()
        spends = await self._tenant_spend(tenant, now)  # type: ignore[misc]
        args: list[int | str] = []
        for scope, s in spends.items():
            args += [self.base(tenant, scope), s.day, s.month, s.day_pico, s.month_pico]
        await self._run("reseed", [self.seeded_key(tenant)], args)
        self.num_reseeds += 1
        if any(s.day_pico or s.month_pico for s in spends.values()):
            self.num_reseeds_raised += 1
            self._reseeds_unlogged += 1
            at = time.monotonic()
            if at - self._reseed_logged_at >= RESEED_LOG_EVERY_S:
                log.warning("Redis had lost quota counters (restarted without persistence, flushed, or a lagging "
                            "replica): %d tenants' day and month spend raised to the ledger's since the last such "
                            "log", self._reseeds_unlogged)
                self._reseed_logged_at, self._reseeds_unlogged = at, 0
