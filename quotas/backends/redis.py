"""Quota state in Redis, shared by every gateway replica, exact under any concurrency and through faults.

Each request's check-and-charge is one Lua script over the keys of its tenant, so two replicas can never
both spend the last unit. All keys of a tenant share the hash tag `{<prefix>:<tenant>}`, so the scripts run
on Redis Cluster too (settle.lua reaches a reservation's counters through the key bases its record names:
keys of the same slot). Sliding windows use Redis' own clock (shared.lua), so replicas' clocks do not matter.
The day and month a budget's money counts for are the request's arrival's (`ReservationRequest.dated_at`), the
instant that dates its ledger row, so a day's counter and that day's ledger rows agree around midnight; but Redis'
clock bounds it: an arrival more than `max_dating_lag_s` before Redis' clock, or after it, counts as that bound
(quotas/limits.py MAX_DATING_LAG_S), so a replica's skewed clock never spends in a long-ended day (a fresh budget)
or a day to come. A request without an arrival is dated by Redis' clock.

A reservation is a record (`<tag>:res:<request id>`: its tokens, money, day, month and scopes) plus an entry
in the tenant's leases. settle.lua finishes it exactly once; `reap` (any replica, any number at once) claims
those whose lease ran out, a replica having died between reserve and settle, and returns them (a live replica
renews the leases of its requests still running: `renew`). Calls time out quickly (50 ms by default); failures
surface as `QuotaBackendError`. A settle that fails, and the cancel of a reserve whose answer was lost, are retried
in the background until Redis answers (quotas/backends/redis_retries.py, `RedisRetries`, mixed in), so one lost
answer never leaves the upper bound charged and the slot held. Waiting for a free connection is back-pressure,
bounded by `pool_wait_s`, not an outage: callers take turns first come, first served (`_turn`), so none waits
longer than the queue ahead of it.

A Redis that lost its data must not reset every budget, and money a replica settled on its fallback during an
outage must reach the counters once: both are quotas/backends/redis_recovery.py's (`RedisRecovery`, mixed in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import MaxConnectionsError, RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.base import Billed, QuotaBackend, QuotaBackendError
from quotas.backends.redis_errors import backend_error
from quotas.backends.redis_recovery import JOURNAL_TTL_S, RedisRecovery, TenantSpend
from quotas.backends.redis_retries import RedisRetries
from quotas.limits import MAX_DATING_LAG_S, WINDOW_S, Decision, ReservationRequest, Spend, Usage

log = logging.getLogger("tiergate.quotas")
T = TypeVar("T")

# tries, each bounded by the call timeout; the script is idempotent per request id. (Retrying for longer, 0.5 s,
# made tests/quotas/test_chaos.py drift in 3 runs of 4: not done until that is understood.)
RESERVE_ATTEMPTS = 3
# A timeout noticed LATE_FACTOR call timeouts or more after its try began means this process's event loop (or its
# CPU) was late to read the answer, not that Redis was: such a try is repeated without counting against
# RESERVE_ATTEMPTS, while the reserve has taken less than LATE_BUDGET_S (which bounds what a hung Redis behind a
# full connection pool, whose waits look late too, adds before the failover's DOWN_AFTER_S sees it). Seen before:
# 503 quota_backend_unavailable answers with Redis idle, from one gateway process at 64 connections on one core
# (bench/gateway.py --workers 2), whose event loop stalled 100 ms and more at its p99.
LATE_FACTOR = 2.0
LATE_BUDGET_S = 0.5
DONE_MARGIN_S = 300  # a settled reservation's tombstone outlives the settle's retries by this much
REAPED_TTL_S = 86_400  # a reaped one waits this long for a late settle to bill its real use
REAP_BATCH = 100  # tenants claimed from, and reservations finished, per round of concurrent calls
RESEED_ROUNDS = 2  # re-seeds one reserve may wait for before it is a retryable failure
REAP_SHARE = 4  # the reaper holds at most 1/REAP_SHARE of the connections at once: requests keep the rest
_HERE = Path(__file__).parent
_SHARED = (_HERE / "shared.lua").read_text()
SCRIPTS = {name: (_SHARED if name in ("reserve", "settle", "spent", "journal", "journal_rows", "reseed") else "") +
           (_HERE / f"{name}.lua").read_text() for name in ("reserve", "settle", "reap", "spent", "journal",
                                                            "journal_rows", "heartbeat", "reseed", "renew",
                                                            "release")}


def _limit(v: int | None) -> int:
    return -1 if v is None else v


def _ms(at: float | None) -> int:
    """An arrival as the scripts take it: epoch milliseconds, -1 for none."""
    return -1 if at is None else int(at * 1000)


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisBackend(RedisRetries, RedisRecovery, QuotaBackend):
    name = "redis"

    def __init__(self, url: str, *, timeout_s: float = 0.05, prefix: str = "tg", max_connections: int = 64,
                 pool_wait_s: float = 2.0, settle_retry_s: float = 600.0, replica_ttl_s: float = 30.0,
                 reap_claim_s: float = 30.0, max_dating_lag_s: float = MAX_DATING_LAG_S,
                 tenant_spend: TenantSpend | None = None) -> None:
        # a bounded pool that makes callers wait for a connection: a burst of requests queues here instead
        # of opening thousands of sockets, and is not mistaken for Redis being down
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s, socket_timeout=timeout_s,
            socket_connect_timeout=max(timeout_s, 1.0), retry_on_timeout=False, health_check_interval=0)
        self.redis = aioredis.Redis(connection_pool=pool)
        # Turns at the pool, first come, first served: every call this backend makes holds one of these while it
        # runs, so the pool never makes anyone wait. (Its own wait is not fair: a released connection's woken
        # waiter must take the pool's lock again, and a task asking in the same step takes the connection first;
        # with more calls than connections in one process, some waited the whole pool_wait_s and were refused, a
        # 503 with Redis idle: 32 of 96 concurrent reserves at 64 connections. asyncio.Semaphore, since Python
        # 3.11.1, hands a released turn to its longest waiter and lets no newcomer pass one.)
        self._turns = asyncio.Semaphore(max_connections)
        self._reap_turns = asyncio.Semaphore(max(1, max_connections // REAP_SHARE))
        self.pool_wait_s = pool_wait_s
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.replica_ttl_s = replica_ttl_s
        self.reap_claim_s = reap_claim_s
        self.max_dating_lag_s = max_dating_lag_s  # the most an arrival may date money before Redis' clock
        self.replica_id = uuid.uuid4().hex[:16]
        self.num_reaped = 0  # reservations this replica's reaper returned
        self.num_late_timeouts = 0  # reserve and spent tries repeated because this process read their answer late
        self.num_register_timeouts = 0  # registrations in the reapers' list that timed out (retried by later requests)
        self._scripts = {name: self.redis.register_script(text) for name, text in SCRIPTS.items()}
        self._registered: set[str] = set()  # tenants this process has put in the reapers' list lately
        RedisRetries.__init__(self, settle_retry_s)  # settles and cancels Redis did not answer, retried
        RedisRecovery.__init__(self, tenant_spend)  # re-seeds, and the failover's `before_reseed`

    # ---- key names ----

    def tag(self, tenant: str) -> str:
        return f"{{{self.prefix}:{tenant}}}"

    def base(self, tenant: str, scope: str) -> str:
        return f"{self.tag(tenant)}:{scope}"

    def record_key(self, tenant: str, request_id: str) -> str:
        return f"{self.tag(tenant)}:res:{request_id}"

    def released_key(self, tenant: str, request_id: str) -> str:
        """A request's slot trace: it freed its slot, or found it gone (release.lua, settle.lua)."""
        return f"{self.tag(tenant)}:released:{request_id}"

    def leases_key(self, tenant: str) -> str:
        return f"{self.tag(tenant)}:leases"

    def seeded_key(self, tenant: str) -> str:
        return f"{self.tag(tenant)}:seeded"

    @property
    def tenants_key(self) -> str:
        return f"{self.prefix}:tenants"

    # ---- turns at the connection pool ----

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """Hold one of the pool's connections' turns for a call (or a few in a row); waiting longer than
        `pool_wait_s` for one is back-pressure (MaxConnectionsError, see `backend_error`)."""
        if self._turns.locked():
            try:
                async with asyncio.timeout(self.pool_wait_s):
                    await self._turns.acquire()
            except TimeoutError as exc:
                raise MaxConnectionsError("No connection available.") from exc
        else:
            await self._turns.acquire()  # free: taken without yielding to the loop
        try:
            yield
        finally:
            self._turns.release()

    # ---- reserve, settle, cancel ----

    async def reserve(self, req: ReservationRequest) -> Decision:
        """The script, tried up to RESERVE_ATTEMPTS times on timeouts (more where the loop, not Redis, was late)."""
        await self._register(req.tenant)
        keys = [self.record_key(req.tenant, req.request_id), self.leases_key(req.tenant)]
        args: list[int | str | float] = [req.request_id, req.tokens, req.money_pico, int(req.lease_s * 1000),
                                         int(WINDOW_S * 1000), len(req.scopes), _ms(req.dated_at),
                                         int(self.max_dating_lag_s * 1000)]
        for lim in req.scopes:
            base = self.base(req.tenant, lim.scope)
            keys += [f"{base}:rpm", f"{base}:tpm", f"{base}:tpmv", f"{base}:tpmsum", f"{base}:inflight"]
            args += [base, _limit(lim.rpm), _limit(lim.tpm), _limit(lim.max_concurrent),
                     _limit(lim.budget_day_pico), _limit(lim.budget_month_pico)]
        args.append(req.follows or "")  # a cascade's retry: the client request's rpm place and slot are its first's
        if self._tenant_spend is None:
            return _decision(req, await self._reserve_script(req, keys, args))
        keys.append(self.seeded_key(req.tenant))
        for _ in range(RESEED_ROUNDS):
            out = await self._reserve_script(req, keys, args)
            if int(out[0]) != 2:
                return _decision(req, out)
            await self._reseed(req.tenant, int(out[1]) / 1000)  # Redis lost the tenant's counters
        out = await self._reserve_script(req, keys, args)
        if int(out[0]) == 2:
            raise QuotaBackendError(f"redis: {req.tenant}'s money counters are not re-seeded yet", transient=True)
        return _decision(req, out)

    async def _reserve_script(self, req: ReservationRequest, keys: list[str],
                              args: list[int | str | float]) -> list[Any]:
        loop, attempt = asyncio.get_running_loop(), 0
        first = started = loop.time()
        while True:
            try:
                async with self._turn():
                    started = loop.time()  # the try's own time: a wait for a turn is not Redis being slow
                    out = await self._scripts["reserve"](keys=keys, args=args)
                break
            except RedisError as exc:
                error = backend_error(exc)
                if isinstance(exc, RedisTimeout):  # the script may have run: retrying with the same id is safe
                    if self._read_late(started, first):
                        continue
                    attempt += 1
                    if attempt < RESERVE_ATTEMPTS:
                        continue
                if not error.back_pressure:
                    # it may have run (a timeout; a connection that closed before the answer): the caller
                    # answers 503 or admits it on the fallback, so what Redis may hold for it is undone,
                    # before the answer where Redis lets us (the client's retry then finds its slot free)
                    await self._cancel_lost(req)
                raise error from exc
        return list(out)

    def _read_late(self, started: float, first: float) -> bool:
        """Whether a try (begun at `started`, its call at `first`, by the loop's clock) that timed out is to be
        repeated without counting: this process read its answer late (see LATE_FACTOR)."""
        now = asyncio.get_running_loop().time()
        if now - started >= LATE_FACTOR * self.timeout_s and now - first < LATE_BUDGET_S:
            self.num_late_timeouts += 1
            return True
        return False

    async def cancel(self, req: ReservationRequest) -> None:
        """Undo `req`'s reservation (request, tokens, money, lease) if it was made; harmless if it was not. A
        follow-on's slot taken over goes back to the attempt it follows unless that one's trace says it is done with
        it (settle.lua `give_back_slot`)."""
        await self._finish(req, tokens=0, money_pico=0, kind="cancel")

    @property
    def released_ttl_s(self) -> int:
        """How long a slot's trace is kept (`released_key`): as long as a follow-on's cancel may still come after it
        (quotas/backends/redis_retries.py `_retry_cancel`: its CANCEL_ATTEMPTS tries a second apart, then for
        max(settle_retry_s, WINDOW_S)), with DONE_MARGIN_S for the first tries and the last wait. The trace is written
        after that follow-on's reserve (its slot was taken over), so the whole of the cancel's retries is within it."""
        return int(max(self.settle_retry_s, WINDOW_S)) + DONE_MARGIN_S

    async def settle_elsewhere(self, req: ReservationRequest, *, money_pico: int) -> None:
        """Bill `req`'s real use, settled on a replica's fallback during an outage, on `req`'s day and month;
        what Redis still holds for the same id (a reserve whose answer was lost) is replaced, not added to,
        and a repeat changes nothing."""
        await self._finish(req, tokens=0, money_pico=money_pico, kind="settle", dated=True)

    async def _finish(self, req: ReservationRequest, *, tokens: int, money_pico: int, kind: str,
                      dated: bool = False, keep_slot: bool = False) -> int:
        """A reservation Redis holds is finished on the day and month its record names. Where it holds none, the
        real use is billed on `req`'s day and month if `dated` (settled on the fallback, which dated it as Redis
        would, by Redis' clock as last seen: billed on the day its local budget counted it, however late the
        outage journal reaches Redis), else on the arrival's as reserve.lua would date it now: clamped against
        Redis' clock, never by the gateway's alone (a skewed one would bill a long-ended day). `keep_slot`: a settle
        that leaves the concurrency slot held (`release` frees it)."""
        bases = [self.base(req.tenant, lim.scope) for lim in req.scopes]
        follows = req.follows if kind == "cancel" else None
        if dated:
            return await self._finish_id(req.tenant, req.request_id, tokens, money_pico, kind, bases, req.day,
                                         req.month, keep_slot=keep_slot, follows=follows)
        return await self._finish_id(req.tenant, req.request_id, tokens, money_pico, kind, bases,
                                     arrival_ms=_ms(req.dated_at), keep_slot=keep_slot, follows=follows)

    async def _finish_id(self, tenant: str, request_id: str, tokens: int, money_pico: int, kind: str,
                         bases: Sequence[str] = (), day: str = "", month: str = "", arrival_ms: int = -1,
                         keep_slot: bool = False, marker: str = "", claimed_until_ms: int = -1,
                         follows: str | None = None) -> int:
        """settle.lua; `marker`: a fallback's ledger row's (`jrow:<id>`), which makes a repeat a no-op for
        JOURNAL_TTL_S (the tombstone alone, for `settle_retry_s` + DONE_MARGIN_S); `claimed_until_ms`: a reap's
        claim's deadline (reap.lua), past which a lease was renewed by its live owner (left to it); `follows`: a
        cancelled follow-on's attempt followed, whose trace says whether the slot taken over goes back to it."""
        keys = [self.record_key(tenant, request_id), self.leases_key(tenant), self.released_key(tenant, request_id)]
        done_ttl = int(self.settle_retry_s) + DONE_MARGIN_S  # ~100 bytes each: 90 MB at 1,000 settles/s
        args = [request_id, tokens, money_pico, kind, done_ttl, REAPED_TTL_S, day, month, arrival_ms,
                int(self.max_dating_lag_s * 1000), len(bases), *bases, "1" if keep_slot else "", JOURNAL_TTL_S,
                claimed_until_ms, self.released_ttl_s]
        if marker:
            keys.append(marker)
        elif follows:
            keys.append(self.released_key(tenant, follows))
        return int(await self._run("settle", keys, args))

    async def release(self, req: ReservationRequest) -> None:
        """`req`'s concurrency slots freed (release.lua), one try: raises `QuotaBackendError` where Redis does not
        answer (the caller retries: quotas/reservations.py `release_slot`; a slot never freed is its lease's)."""
        await self._run("release", [self.released_key(req.tenant, req.request_id),
                                    *(f"{self.base(req.tenant, lim.scope)}:inflight" for lim in req.scopes)],
                        [req.request_id, self.released_ttl_s])

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """One script, one try, in a turn at the pool; a failure as ours (`backend_error`)."""
        try:
            async with self._turn():
                return await self._scripts[script](keys=keys, args=args)
        except RedisError as exc:
            raise backend_error(exc) from exc

    async def _register(self, tenant: str) -> None:
        """Put the tenant in the list the reapers walk (once per reaper round per process). A timeout here is not
        the request's failure: the tenant is in the list from before unless Redis lost it, the reserve that follows
        says whether Redis answers, and the next request registers again. (It was a 503: every reaper round, each
        request in flight for a tenant registered it at once, and at 64 connections on one core a stalled loop
        timed some out: 10-16 answers in 4,500-14,300, bench/gateway.py on a 16-CPU Xeon.)"""
        if tenant in self._registered:
            return
        try:
            async with self._turn():
                await self.redis.sadd(self.tenants_key, tenant)
        except RedisError as exc:
            error = backend_error(exc)
            if not error.transient:  # refused, reset: an outage, for the failover to see at once
                raise error from exc
            self.num_register_timeouts += 1
            return
        self._registered.add(tenant)

    # ---- reaping, reads ----

    async def reap(self, billed: Billed | None = None) -> int:
        """Say this replica is alive, then return every tenant's reservations whose lease ran out: billed
        what the ledger recorded for them (`billed`), or refunded. Each is returned once however many
        replicas reap at the same time."""
        try:
            async with self._turn():  # one turn for the heartbeat and the walk of the tenants' list
                self.num_replicas = max(1, int(await self._scripts["heartbeat"](
                    keys=[f"{self.prefix}:replicas"], args=[self.replica_id, int(self.replica_ttl_s * 1000)])))
                self._registered.clear()  # re-register as tenants come back (a restarted Redis lost the list)
                tenants = [_str(t) async for t in self.redis.sscan_iter(self.tenants_key, count=1000)]
            expired: list[tuple[str, str, int]] = []  # (tenant, request id, the claim's deadline)
            for i in range(0, len(tenants), REAP_BATCH):
                chunk = tenants[i:i + REAP_BATCH]
                claimed = await asyncio.gather(*(self._reaping(self._claim(t)) for t in chunk))
                expired += [(t, _str(rid), until) for t, (until, ids) in zip(chunk, claimed, strict=True)
                            for rid in ids]
            if not expired:
                return 0
            amounts = await billed([rid for _, rid, _ in expired]) if billed is not None else {}
            finished = []
            for i in range(0, len(expired), REAP_BATCH):
                finished += await asyncio.gather(*(self._reaping(
                    self._finish_id(t, rid, 0, amounts[rid], "settle") if rid in amounts
                    else self._finish_id(t, rid, 0, 0, "reap", claimed_until_ms=until))
                    for t, rid, until in expired[i:i + REAP_BATCH]))
        except RedisError as exc:
            raise backend_error(exc) from exc
        returned = sum(1 for code in finished if code == 1)
        self.num_reaped += returned
        if returned:
            log.warning("returned %d reservations whose lease ran out (%d billed from the ledger)", returned,
                        sum(1 for _, rid, _ in expired if rid in amounts))
        return returned

    async def renew(self, reqs: Sequence[ReservationRequest]) -> None:
        """Each reservation's lease and slots pushed ahead (renew.lua), a script a reservation, with the reaper's share
        of the connections (only requests older than a part of their lease are renewed: few)."""
        for i in range(0, len(reqs), REAP_BATCH):
            await asyncio.gather(*(self._reaping(self._renew_one(req)) for req in reqs[i:i + REAP_BATCH]))

    async def _renew_one(self, req: ReservationRequest) -> None:
        keys = [self.record_key(req.tenant, req.request_id), self.leases_key(req.tenant),
                *(f"{self.base(req.tenant, lim.scope)}:inflight" for lim in req.scopes)]
        await self._run("renew", keys, [req.request_id, int(req.lease_s * 1000), int(WINDOW_S * 1000)])

    async def _claim(self, tenant: str) -> tuple[int, list[Any]]:
        """The tenant's expired leases claimed: the claim's deadline (ms, Redis' clock) and their ids."""
        async with self._turn():
            out = list(await self._scripts["reap"](keys=[self.leases_key(tenant)],
                                                   args=[int(self.reap_claim_s * 1000), REAP_BATCH]))
        return int(out[0]), out[1:]

    async def _reaping(self, call: Coroutine[Any, Any, T]) -> T:
        """A call of the reaper's: at most 1/REAP_SHARE of the connections' turns at once, so a round of
        REAP_BATCH concurrent calls never queues the requests' calls behind it."""
        async with self._reap_turns:
            return await call

    async def spent(self, tenant: str, scopes: Sequence[str], now: float) -> dict[str, tuple[int, int]] | None:
        """Today's and this month's spend by Redis' clock (`now` is not used: one clock dates the money). One try,
        repeated while the timeouts are the loop's (read late, as `reserve` does): `auto` routing reads it for
        each request with budget thresholds, and a lost answer there routes as if the tenant had no budget."""
        args = [self.base(tenant, s) for s in scopes]
        loop = asyncio.get_running_loop()
        first = started = loop.time()
        while True:
            try:
                async with self._turn():
                    started = loop.time()
                    out = await self._scripts["spent"](keys=[], args=args)
                break
            except RedisError as exc:
                if isinstance(exc, RedisTimeout) and self._read_late(started, first):
                    continue
                raise backend_error(exc) from exc
        return {scope: (int(out[2 + 2 * i]), int(out[3 + 2 * i])) for i, scope in enumerate(scopes)}

    async def ping(self) -> bool:
        try:
            async with self._turn():
                return bool(await self.redis.ping())
        except RedisError:
            return False

    async def close(self) -> None:
        if self._background:  # settles and cancels still retrying get a last moment
            await asyncio.wait(self._background, timeout=2.0)
        await self.redis.aclose()


def _decision(req: ReservationRequest, out: list[Any]) -> Decision:
    """reserve.lua's answer as a Decision, with each scope's spend and Redis' clock."""
    n = len(req.scopes)
    if int(out[0]) == 0:
        reason, index, wait_ms = _str(out[1]), int(out[2]), int(out[3])
        clock_ms, day, month = int(out[4]), _str(out[5]), _str(out[6])
        spent = {lim.scope: Spend(day, month, int(out[7 + 2 * i]), int(out[8 + 2 * i]))
                 for i, lim in enumerate(req.scopes)}
        scope = req.scopes[index].scope if n else None
        return Decision(False, reason, scope, max(0.0, wait_ms / 1000), spent=spent, clock_s=clock_ms / 1000)
    clock_ms, day, month = int(out[1]), _str(out[2]), _str(out[3])
    usage, spent = {}, {}
    for i, lim in enumerate(req.scopes):
        nreq, tokens, reset_ms, day_pico, month_pico = (int(x) for x in out[4 + 5 * i: 9 + 5 * i])
        usage[lim.scope] = Usage(nreq, tokens, reset_ms / 1000, reset_ms / 1000)
        spent[lim.scope] = Spend(day, month, day_pico, month_pico)
    return Decision(True, usage=usage, spent=spent, clock_s=clock_ms / 1000)
