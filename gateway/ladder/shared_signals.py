"""The ladder's error rate judged on every worker's window, for the workers sharing its state in Redis (`tiergate serve
--workers N`, which needs Redis; replicas on one Redis).

Each worker's Signals hear only its own connections. A tenant on one keep-alive connection lands all its requests on one
worker, which then sees few of the other tenants' answers (fewer than CONTEST_MIN): it cannot set that tenant's 5xx
aside and raised the level for everyone; another worker, seeing none of them, lowered it a minute later; the first
raised it again. So at each tick every worker publishes its window's answers and 5xx per tenant (the tenants active in
its window, no more) under `<prefix>:degrade:signals:<worker>`, expiring after TTL_MS (a worker that stops drops out),
names itself in the set `<prefix>:degrade:signals`, reads every live worker's (an id whose summary expired is taken out
of the set) and judges the error rate on the sum: every worker judges the same numbers, and one tenant's 5xx are set
aside, or not, by all the tenants' answers, whichever worker they landed on. Only counts cross processes, no
timestamps: each worker's window is its own minute, and Redis's clock expires the summaries.

What is shared: the error rate only. The dispatch wait's p95 is still each worker's own window's (merging it needs each
worker's waits per tenant, as a histogram; not done); tiers down, Redis down and KV use are each worker's view of
things every worker sees.

A worker with no live peer judges its own window exactly as before. Redis failing (a summary not written, or the
others' not read): the worker judges its own window, logged once until Redis answers again (the tick's read of the
ladder's state fails too, and the tick with it). SQLite and PostgreSQL stores share nothing: each process judges its
own window (one process per host, or replicas without Redis).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from typing import Any

from redis.exceptions import RedisError

from gateway.ladder.signals import CONTEST_MIN, Signals
from gateway.ladder.state import LadderStore, RedisLadderStore
from quotas.fault_log import redacted
from tiers.tenant_counts import BAD, OUTCOMES, TenantCounts, left_out

log = logging.getLogger("tiergate.ladder")

TTL_MS = 3_000  # a summary's least life: several ticks (TIERGATE_LADDER_TICK_S, 0.5 s by default)...
TICKS_ALIVE = 4  # ...and at least this many of the worker's own ticks, as far apart as its last two were...
SLACK_MS = 1_500  # ...and this (a slow tick): a peer does not drop out between two of its ticks
_numbers = itertools.count()  # tells apart the controllers of one process (tests build several)


class SharedSignals:
    """One worker's side of the exchange: `read` publishes its window, reads the others' and judges the sum."""

    def __init__(self, redis: Any, *, prefix: str = "tg", worker: str | None = None, ttl_ms: int = TTL_MS) -> None:
        self.redis = redis
        # a random part: replicas in containers sharing a host name (host networking) have the same pids
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}:{next(_numbers)}:{secrets.token_hex(4)}"
        self.members_key = f"{prefix}:degrade:signals"
        self.ttl_ms = ttl_ms
        self._last: float | None = None  # when this worker last published (monotonic)
        self._failed: str | None = None  # the Redis fault last logged; None while Redis answers

    @classmethod
    def for_store(cls, store: LadderStore) -> SharedSignals | None:
        """The exchange over a Redis store's client; None for a store without Redis (nothing shared)."""
        return cls(store.redis, prefix=store.prefix) if isinstance(store, RedisLadderStore) else None

    def key(self, worker: str) -> str:
        return f"{self.members_key}:{worker}"

    def read(self, signals: Signals) -> dict[str, float]:
        """`signals.read()`, with the error rate judged on every live worker's window (the module's docstring)."""
        metrics = signals.read()
        own = signals.outcomes()
        try:
            others = self._exchange(own)
        except RedisError as exc:
            why = redacted(str(exc)) or type(exc).__name__
            if why != self._failed:
                self._failed = why
                log.error("degrade ladder: the workers' signals could not be shared (Redis failed, %s), this worker "
                          "judges its own: %s", type(exc).__name__, why)
            return metrics
        if self._failed is not None:
            self._failed = None
            log.warning("degrade ladder: the workers' signals are shared again")
        if others:
            merged = merge(own, others)
            metrics["error_rate"] = merged.rate_without(left_out(merged, CONTEST_MIN))
        return metrics

    def _life_ms(self) -> int:
        """How long this worker's summary lives: TTL_MS, or longer where its ticks are further apart (a long
        TIERGATE_LADDER_TICK_S, a slow tick), so that it never expires before the next one replaces it (a peer
        dropping in and out of the sum would change the numbers at each tick and restart the triggers' timers)."""
        now = time.monotonic()
        gap_ms = 0.0 if self._last is None else (now - self._last) * 1000
        self._last = now
        return max(self.ttl_ms, math.ceil(TICKS_ALIVE * gap_ms) + SLACK_MS if gap_ms else 0)

    def _exchange(self, own: TenantCounts) -> list[dict[str, list[int]]]:
        """Publish `own`, and the live others' summaries (each {tenant: [answers, 5xx]})."""
        life_ms = self._life_ms()
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.key(self.worker), json.dumps(own.by_tenant), px=life_ms)
            pipe.sadd(self.members_key, self.worker)
            pipe.pexpire(self.members_key, life_ms, nx=True)  # gone when every worker is (no one publishing)...
            pipe.pexpire(self.members_key, life_ms, gt=True)  # ...not before the longest-lived summary
            pipe.smembers(self.members_key)
            members = pipe.execute()[-1]
        others = sorted(w for w in (m.decode() for m in members) if w != self.worker)
        if not others:
            return []
        raw = self.redis.mget([self.key(w) for w in others])
        gone = [w for w, r in zip(others, raw, strict=True) if r is None]
        if gone:
            self.redis.srem(self.members_key, *gone)
        return [summary for r in raw if r is not None and (summary := _summary(r)) is not None]


def merge(own: TenantCounts, others: list[dict[str, list[int]]]) -> TenantCounts:
    """The sum of the windows: each tenant's answers and 5xx on every worker."""
    merged = own.copy()
    for summary in others:
        for tenant, (n, bad) in summary.items():
            counts = merged.by_tenant.setdefault(tenant, [0, 0])
            counts[OUTCOMES] += n
            counts[BAD] += bad
            merged.n += n
            merged.bad += bad
    return merged


def _summary(raw: bytes) -> dict[str, list[int]] | None:
    """A peer's summary as published; one this version cannot read (another version's) is left out of the sum."""
    try:
        summary = json.loads(raw)
        if isinstance(summary, dict) and all(
                isinstance(t, str) and isinstance(c, list) and len(c) == 2 and all(type(x) is int for x in c)
                and 0 <= c[BAD] <= c[OUTCOMES] and c[OUTCOMES] > 0 for t, c in summary.items()):
            return summary
    except ValueError:
        pass
    return None
