"""The running gateway keeps checking that its Redis may not evict keys (start-up's check: redis_eviction.py).

Start-up refuses a Redis whose maxmemory-policy may evict quota counters, reservations and idempotency records, but
the policy can change while the gateway runs: an operator's CONFIG SET, or a managed Redis failing over to a replica
configured otherwise. So every TIERGATE_REDIS_EVICTION_CHECK_S the watch asks again, with the async client (one
round trip, never on a request's path), and:

- logs each change once (an error when the Redis may now evict, a line when it no longer may), not every round;
- exports `tiergate_redis_may_evict` (1 or 0; absent while the policy cannot be read) and
  `tiergate_redis_evicted_keys` (the server's INFO stats count, since it started or CONFIG RESETSTAT);
- shows both in /health's admin details (`redis`), and makes /health answer 503 while the Redis may evict, unless
  TIERGATE_REDIS_ALLOW_EVICTION=1. A gateway restarted now would refuse to start on that Redis; answering ready
  meanwhile would keep a fleet on it only until its next deploy, and hide the change from the orchestrator until
  then. Requests already routed here are still served (the ledger still records each one exactly): the risk is
  keys evicted once Redis is full, not a ledger that cannot write, which is what refuses requests (handle.py).

Keys already evicted (`evicted_keys` growing) are logged once per spell of evictions and counted, but do not hold
readiness back: under `noeviction` the count cannot grow, so it tells of a past the operator must reconcile, and
refusing traffic now brings no key back. A CONFIG refused (a managed Redis) is logged once, as at start-up, and
readiness follows the last policy read; INFO answers even there, so evictions are still seen. A Redis that does not
answer is the quota backend's outage (TIERGATE_REDIS_FAILURE_MODE, logged there): the last verdict stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from redis.exceptions import ResponseError

from gateway.redis_eviction import CHECK_TIMEOUT_S, FIX, eviction_problem, parse_policy
from gateway.settings import Settings
from quotas.fault_log import FaultLog, redacted

log = logging.getLogger("tiergate.gateway")


def eviction_watch(settings: Settings, registry: CollectorRegistry) -> RedisEvictionWatch | None:
    """The watch of TIERGATE_REDIS_URL's Redis, its gauges in `registry`; None without Redis."""
    if not settings.redis_url:
        return None
    watch = RedisEvictionWatch(settings.redis_url, every_s=settings.redis_eviction_check_s,
                               allow_eviction=settings.redis_allow_eviction)
    registry.register(EvictionCollector(watch))
    return watch


@dataclass(frozen=True)
class PolicyReading:
    """One round's answer: the policy (None: CONFIG refused or not answered, `unread` says why) and the count of
    keys the server has evicted (None: INFO not answered)."""

    policy: str | None
    maxmemory: int | None
    evicted_keys: int | None
    unread: str | None = None


class RedisEvictionWatch:
    """What the latest round found of the Redis at `url`; `check()` runs one round, `start()` one now and then one
    every `every_s` until `stop()`."""

    def __init__(self, url: str, *, every_s: float, allow_eviction: bool) -> None:
        self.where = redacted(url)
        self.every_s, self.allow_eviction = every_s, allow_eviction
        self.client = aioredis.Redis.from_url(url, socket_timeout=CHECK_TIMEOUT_S,
                                              socket_connect_timeout=CHECK_TIMEOUT_S, decode_responses=True)
        self.policy: str | None = None
        self.maxmemory: int | None = None
        self.problem: str | None = None  # why this Redis may evict keys, as of the last policy read
        self.unread: str | None = None  # why the last round could not read the policy (CONFIG refused)
        self.evicted_keys: int | None = None
        self.rounds = 0  # rounds that read Redis (a test waits for some to pass)
        self._task: asyncio.Task[None] | None = None
        self._evicting = False  # the count grew at the last round
        self._faults = FaultLog(log, f"checking the maxmemory-policy of Redis at {self.where}", level=logging.INFO)

    @property
    def may_evict(self) -> bool | None:
        """Whether the Redis may evict keys; None until a round read its policy."""
        return None if self.policy is None else self.problem is not None

    @property
    def not_ready_reason(self) -> str | None:
        """Why /health says not ready: the Redis may evict keys and the operator has not allowed it."""
        if self.problem is None or self.allow_eviction:
            return None
        return f"{self.problem}; {FIX}"

    def details(self) -> dict[str, Any]:
        """/health's admin details."""
        return {"may_evict": self.may_evict, "maxmemory_policy": self.policy, "maxmemory": self.maxmemory,
                "evicted_keys": self.evicted_keys, "allowed": self.allow_eviction,
                "problem": self.problem, "unread": self.unread}

    async def start(self) -> None:
        """A first round now (a change since start-up's check shows before the first request), then one every
        `every_s` in a task of its own."""
        await self.check()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self.check()

    async def check(self) -> None:
        """One round: read, then log what changed. A fault is logged once until a round works again."""
        try:
            reading = await self._read()
        except Exception as exc:  # a store fault (down now) is one line, anything else a bug with its traceback
            self._faults.failed(exc)
            return
        self._faults.ok()
        self._judge(reading)
        self._count_evictions(reading.evicted_keys)
        self.rounds += 1

    async def _read(self) -> PolicyReading:
        unread = None
        try:
            policy, maxmemory = parse_policy(await self.client.config_get("maxmemory*"))
            if policy is None or maxmemory is None:
                unread = "CONFIG GET did not return it"
        except ResponseError as exc:  # CONFIG renamed away or denied by an ACL: a managed Redis, most often
            policy, maxmemory, unread = None, None, f"CONFIG GET answered: {redacted(str(exc))}"
        try:
            evicted = (await self.client.info("stats")).get("evicted_keys")
        except ResponseError:  # INFO refused too: nothing to count
            evicted = None
        return PolicyReading(policy, maxmemory, evicted if isinstance(evicted, int) else None, unread)

    def _judge(self, reading: PolicyReading) -> None:
        """Takes the policy read, logging a change of verdict once. Start-up logged (or refused) what the first
        round finds, so that round logs only what start-up would have refused: a change since."""
        first = self.rounds == 0
        if reading.unread is not None or reading.policy is None or reading.maxmemory is None:
            if self.unread is None and not first:  # the policy was readable (a failover to a managed replica?)
                log.warning("could not check the maxmemory-policy of Redis at %s any more (%s); it must be "
                            "`noeviction`: check it with your provider; /health keeps the last policy read",
                            self.where, reading.unread)
            self.unread = reading.unread or "CONFIG GET did not return it"
            return
        self.unread = None
        problem = eviction_problem(self.where, reading.policy, reading.maxmemory)
        changed = (reading.policy, reading.maxmemory) != (self.policy, self.maxmemory)
        was = self.problem
        self.policy, self.maxmemory, self.problem = reading.policy, reading.maxmemory, problem
        if not changed and not first:
            return
        if problem is not None and not self.allow_eviction:
            log.error("%s; /health answers 503 until you %s", problem, FIX)
        elif problem is not None and not first:
            log.warning("%s; running on (TIERGATE_REDIS_ALLOW_EVICTION=1)", problem)
        elif problem is None and was is not None:
            log.info("Redis at %s now runs with maxmemory %d and maxmemory-policy %s: it evicts no key", self.where,
                     reading.maxmemory, reading.policy)

    def _count_evictions(self, evicted: int | None) -> None:
        """Logs the start of each spell of evictions (the count grew since the last round, or is above 0 at the
        first): keys lost, spend maybe forgiven. Once a spell, not every round while Redis keeps evicting."""
        before, self.evicted_keys = self.evicted_keys, evicted
        if evicted is None:
            return
        grew = evicted > 0 if before is None or evicted < before else evicted > before  # fewer: Redis restarted
        if grew and not self._evicting:
            log.log(logging.WARNING if self.allow_eviction else logging.ERROR,
                    "Redis at %s has evicted keys (INFO stats evicted_keys: %d%s): quota counters, reservations, "
                    "idempotency records or cache entries may be gone, spend forgiven; its maxmemory-policy must be "
                    "`noeviction`", self.where, evicted, "" if before is None else f", {evicted - before} since the "
                    "last check")
        self._evicting = grew


class EvictionCollector:
    """`tiergate_redis_may_evict` and `tiergate_redis_evicted_keys`, read from the watch at scrape time (with
    several workers, the answering worker's view: they all watch the one Redis)."""

    def __init__(self, watch: RedisEvictionWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        may = GaugeMetricFamily("tiergate_redis_may_evict",
                                "1 while the Redis of TIERGATE_REDIS_URL may evict keys (a maxmemory and a "
                                "maxmemory-policy but noeviction), 0 while it may not; absent until a policy is "
                                "read.")
        if self.watch.may_evict is not None:
            may.add_metric([], 1 if self.watch.may_evict else 0)
        yield may
        evicted = GaugeMetricFamily("tiergate_redis_evicted_keys",
                                    "Keys the Redis has evicted since it started or CONFIG RESETSTAT (INFO stats).")
        if self.watch.evicted_keys is not None:
            evicted.add_metric([], self.watch.evicted_keys)
        yield evicted
