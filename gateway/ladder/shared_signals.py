"""The ladder's error rate and wait p95 judged on every worker's window, for the workers sharing its state in Redis
(`tiergate serve --workers N`, which needs Redis; replicas on one Redis).

Each worker's Signals hear only its own connections. A tenant on one keep-alive connection lands all its requests on one
worker, which then sees few of the other tenants' answers (fewer than CONTEST_MIN): it cannot set that tenant's 5xx
aside and raised the level for everyone; another worker, seeing none of them, lowered it a minute later; the first
raised it again. So at each tick every worker publishes its window's answers and 5xx per tenant (the tenants active in
its window, no more) under `<prefix>:degrade:signals:<worker>`, expiring after TTL_MS (a worker that stops drops out),
names itself in the set `<prefix>:degrade:signals`, reads every live worker's (an id whose summary expired is taken out
of the set) and judges the error rate on the sum: every worker judges the same numbers, and one tenant's 5xx are set
aside, or not, by all the tenants' answers, whichever worker they landed on. The dispatch wait's p95 likewise: each
tenant's waits travel as a histogram of log buckets (Signals keeps it as waits come and go: BUCKETS_PER_DOUBLING a
doubling, each read as its geometric middle, within 2.2% of the wait), and the p95, and whose waits it leaves out, are
judged as Signals judges them, on the sum. Only counts cross processes, no timestamps: each worker's window is its own
minute, and Redis's clock expires the summaries. Tiers down, Redis down and KV use are each worker's view of things
every worker sees: not shared. A summary holds the tenants active in the worker's window: with 300 tenants, each with
200 waits (log-normal, sigma 1.5) in about 100 buckets, 314 KB; waits bunched in fewer buckets make it smaller.

A worker with no live peer judges its own window exactly as before. Redis failing (a summary not written, or the
others' not read): the worker judges its own window, logged once until Redis answers again (the tick's read of the
ladder's state fails too, and the tick with it). SQLite and PostgreSQL stores share nothing: each process judges its
own window (one process per host, or replicas without Redis).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
from collections import Counter
from typing import Any

from redis.exceptions import RedisError

from gateway.ladder.signals import BUCKETS_PER_DOUBLING, CONTEST_MIN, MIN_WAIT_S, Signals, p95_rank
from gateway.ladder.state import LadderStore, RedisLadderStore
from quotas.fault_log import redacted
from tiers.tenant_counts import BAD, GAP, OUTCOMES, TenantCounts, left_out

log = logging.getLogger("tiergate.ladder")
Summary = dict[str, Any]  # {"outcomes": {tenant: [answers, 5xx]}, "waits": {tenant: {bucket: waits}}}

TTL_MS = 3_000  # a summary's life: several ticks (TIERGATE_LADDER_TICK_S, 0.5 s by default)
_numbers = itertools.count()  # tells apart the controllers of one process (tests build several)


class SharedSignals:
    """One worker's side of the exchange: `read` publishes its window, reads the others' and judges the sum."""

    def __init__(self, redis: Any, *, prefix: str = "tg", worker: str | None = None, ttl_ms: int = TTL_MS) -> None:
        self.redis = redis
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}:{next(_numbers)}"
        self.members_key = f"{prefix}:degrade:signals"
        self.ttl_ms = ttl_ms
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
        counts, waits = signals.window()
        own = {"outcomes": counts.by_tenant, "waits": waits}
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
            merged = merge(counts, [o["outcomes"] for o in others])
            metrics["error_rate"] = merged.rate_without(left_out(merged, CONTEST_MIN))
            metrics["queue_wait_p95_s"] = wait_p95(merge_waits([own["waits"], *(o["waits"] for o in others)]))
        return metrics

    def _exchange(self, own: Summary) -> list[Summary]:
        """Publish `own`, and the live others' summaries."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.key(self.worker), json.dumps(own), px=self.ttl_ms)
            pipe.sadd(self.members_key, self.worker)
            pipe.pexpire(self.members_key, self.ttl_ms)  # gone when every worker is
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


def merge_waits(summaries: list[dict[str, dict[int, int]]]) -> dict[str, Counter[int]]:
    merged: dict[str, Counter[int]] = {}
    for summary in summaries:
        for tenant, hist in summary.items():
            merged.setdefault(tenant, Counter()).update(hist)
    return merged


def _value(bucket: int) -> float:
    """A bucket's wait: its geometric middle (0 for the first: MIN_WAIT_S or less)."""
    return MIN_WAIT_S * 2 ** ((bucket - 0.5) / BUCKETS_PER_DOUBLING) if bucket > 0 else 0.0


def _p95(hist: Counter[int]) -> float:
    n = hist.total()
    if not n:
        return 0.0
    rank, seen = p95_rank(n), 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= rank:
            return _value(bucket)
    raise AssertionError("a rank beyond the count")


def wait_p95(per: dict[str, Counter[int]]) -> float:
    """The waits' p95 as Signals judges it (gateway/ladder/signals.py), on every worker's: without the tenant with
    the most waits (and those that stand out with it) when the others have CONTEST_MIN of theirs."""
    total: Counter[int] = Counter()
    for hist in per.values():
        total.update(hist)

    def rest(left: frozenset[str]) -> Counter[int]:
        out = total.copy()
        for t in left:
            out.subtract(per[t])
        return +out  # without the buckets emptied

    if len(per) > 1:
        counts = TenantCounts()
        counts.by_tenant = {t: [h.total(), 0] for t, h in per.items()}
        counts.n = sum(c[OUTCOMES] for c in counts.by_tenant.values())
        left = left_out(counts, CONTEST_MIN, by=OUTCOMES,
                        stands_out=lambda t, left: _p95(per[t]) > GAP * _p95(rest(left)))
        if left:
            return _p95(rest(left))
    return _p95(total)


def _summary(raw: bytes) -> Summary | None:
    """A peer's summary as published; one this version cannot read (another version's) is left out of the sum."""
    try:
        summary = json.loads(raw)
        outcomes, waits = summary["outcomes"], summary["waits"]
        if not isinstance(outcomes, dict) or not isinstance(waits, dict) or not all(
                isinstance(t, str) and isinstance(c, list) and len(c) == 2 and all(type(x) is int for x in c)
                and 0 <= c[BAD] <= c[OUTCOMES] and c[OUTCOMES] > 0 for t, c in outcomes.items()):
            return None
        hists = {t: {int(b): n for b, n in h.items()} for t, h in waits.items()}
        if all(isinstance(t, str) and all(type(n) is int and n > 0 and b >= 0 for b, n in h.items())
               for t, h in hists.items()):
            return {"outcomes": outcomes, "waits": hists}
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return None
