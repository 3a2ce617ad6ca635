"""Prometheus metrics the gateway exports (all named `tiergate_*`), in a registry per app."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from gateway.metrics_text import MetricsText
from quotas.ledger import LedgerRow
from tiers.breaker import STATE_VALUE
from tiers.fleet import Fleet

ENGINE_STATS = (
    ("kv_utilisation", "tiergate_engine_kv_utilisation", "Share of the engine's KV cache blocks in use (0-1)."),
    ("tokens_per_s", "tiergate_engine_tokens_per_second", "Tokens the engine generated per second, recently."),
    ("num_running", "tiergate_engine_running", "Sequences the engine is generating."),
    ("num_waiting", "tiergate_engine_waiting", "Sequences waiting inside the engine."),
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
log = logging.getLogger("tiergate.metrics")
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _FleetCollector:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Any:
        g = GaugeMetricFamily("tiergate_tier_replicas_ready", "Healthy replicas per tier.", labels=["tier"])
        for tier, reps in self.fleet.replicas.items():
            g.add_metric([tier], sum(r.healthy for r in reps))
        yield g
        r = GaugeMetricFamily("tiergate_tier_engine_restarts", "Engine restarts per tier.", labels=["tier"])
        for tier, reps in self.fleet.replicas.items():
            r.add_metric([tier], sum(rep.restarts for rep in reps))
        yield r
        b = GaugeMetricFamily("tiergate_replica_breaker_state",
                              "Circuit breaker per replica: 0 closed, 1 half-open (probing), 2 open.",
                              labels=["tier", "replica"])
        for tier, reps in self.fleet.replicas.items():
            for rep in reps:
                b.add_metric([tier, str(rep.index)], STATE_VALUE[rep.breaker.state])
        yield b
        # what local engines report on /health, per replica (absent until an engine reports it)
        for stat, name, doc in ENGINE_STATS:
            g = GaugeMetricFamily(name, doc, labels=["tier", "replica"])
            for tier, reps in self.fleet.replicas.items():
                for rep in reps:  # read once: the health poller replaces a replica's stats whole, and a scrape
                    stats = rep.stats  # renders on its own thread (gateway/routes/health.py)
                    if stat in stats:
                        g.add_metric([tier, str(rep.index)], stats[stat])
            yield g


class _QueueCollector:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        waiting = GaugeMetricFamily("tiergate_queue_depth", "Requests waiting for a dispatch slot.", labels=["tier"])
        busy = GaugeMetricFamily("tiergate_queue_in_flight", "Requests dispatched to a tier.", labels=["tier"])
        for tier, q in self.metrics.queues.items():
            waiting.add_metric([tier], q.num_waiting)
            busy.add_metric([tier], q.in_flight)
        yield waiting
        yield busy
        if self.metrics.ladder is not None:
            level = GaugeMetricFamily("tiergate_degrade_level", "The degradation level in force.")
            level.add_metric([], self.metrics.ladder.level)
            yield level
            in_sync = GaugeMetricFamily("tiergate_degrade_ladder_in_sync",
                                        "1: this worker applies the ladder the last reload put in force; 0: it keeps "
                                        "its own (its copy of the file is not that ladder, /admin/degrade/ says why).")
            in_sync.add_metric([], 1.0 if self.metrics.ladder.in_sync else 0.0)
            yield in_sync


class _RolloutCollector:
    """Each tier's latest rollout, read at scrape time: its stage, shares, and the guards' latest reading."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        stage = GaugeMetricFamily("tiergate_rollout_stage", "Each tier's latest rollout: 1 for its stage.",
                                  labels=["tier", "candidate", "stage"])
        share = GaugeMetricFamily("tiergate_rollout_share",
                                  "Share of new conversations each version answers (a shadow's copies aside).",
                                  labels=["tier", "version"])
        shadow = GaugeMetricFamily("tiergate_rollout_shadow_share", "Share of requests a shadow copies.",
                                   labels=["tier", "version"])
        diverged = GaugeMetricFamily("tiergate_rollout_divergence",
                                     "Mean divergence of the candidate's shadowed answers in the guards' window (0-1).",
                                     labels=["tier", "version"])
        breached = GaugeMetricFamily("tiergate_rollout_guard_breached", "Guards breached at the latest evaluation.",
                                     labels=["tier"])
        for r in self.metrics.rollouts.status() if self.metrics.rollouts is not None else []:
            stage.add_metric([r["tier"], r["candidate"], r["stage"]], 1)
            on_candidate = {"full": 1.0, "rolled_back": 0.0, "shadow": 0.0}.get(r["stage"], r["share"])
            share.add_metric([r["tier"], r["candidate"]], on_candidate)
            share.add_metric([r["tier"], r["baseline"]], 1.0 - on_candidate)
            if r["stage"] == "shadow":
                shadow.add_metric([r["tier"], r["candidate"]], r["shadow"])
            guard = r["guard"]
            if guard is not None:
                breached.add_metric([r["tier"]], len(guard["breached"]))
                if guard["versions"][r["candidate"]]["divergence"] is not None:
                    diverged.add_metric([r["tier"], r["candidate"]], guard["versions"][r["candidate"]]["divergence"])
        yield from (stage, share, shadow, diverged, breached)


class GatewayMetrics:
    def __init__(self, fleet: Fleet | None = None) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._text = MetricsText(reg)
        self.requests = Counter("tiergate_requests", "Finished requests (after admission).",
                                ["tenant", "tier", "status"], registry=reg)
        self.tokens = Counter("tiergate_tokens", "Tokens by kind (input, output).",
                              ["tenant", "tier", "kind"], registry=reg)
        self.price = Counter("tiergate_price_usd", "What tenants were charged, USD.", ["tenant", "tier"],
                             registry=reg)
        self.compute_cost = Counter("tiergate_compute_cost_usd", "What the compute cost us, USD.",
                                    ["tenant", "tier"], registry=reg)
        self.refusals = Counter("tiergate_refusals", "Requests refused before admission, by reason.",
                                ["reason"], registry=reg)
        self.ttft = Histogram("tiergate_time_to_first_token_seconds", "Arrival to first output token.",
                              ["tier"], buckets=LATENCY_BUCKETS, registry=reg)
        self.total = Histogram("tiergate_request_duration_seconds", "Arrival to last byte.", ["tier"],
                               buckets=LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("tiergate_time_per_output_token_seconds",
                              "Time per output token after the first (total minus TTFT over output tokens - 1).",
                              ["tier"], buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2), registry=reg)
        self.cache = Counter("tiergate_cache_requests", "Cache lookups by result (hit, miss, bypass).",
                             ["tenant", "result"], registry=reg)
        self.cache_savings = Counter("tiergate_cache_savings_usd", "What cache hits saved tenants, USD.", ["tenant"],
                                     registry=reg)
        self.route_savings = Counter("tiergate_routing_savings_usd",
                                     "What routing to a cheaper tier than requested saved, USD.", ["tenant"],
                                     registry=reg)
        self.cascades = Counter("tiergate_cascades", "Cheap answers retried on a dearer tier, by why they failed.",
                                ["from_tier", "to_tier", "reason"], registry=reg)
        self.overhead = Histogram("tiergate_gateway_overhead_seconds",
                                  "Time spent in the gateway itself (total minus upstream time).",
                                  buckets=OVERHEAD_BUCKETS, registry=reg)
        self.queue_wait = Histogram("tiergate_queue_wait_seconds", "Time waiting for a dispatch slot.", ["tier"],
                                    buckets=LATENCY_BUCKETS, registry=reg)
        self.redis_up = Gauge("tiergate_redis_up", "1 while the shared quota backend answers, 0 while it fails.",
                              registry=reg)
        self.redis_up.set(1)
        self.redis_transitions = Counter("tiergate_redis_state_changes", "Times the quota backend went down or up.",
                                         ["to"], registry=reg)
        if fleet is not None:
            reg.register(_FleetCollector(fleet))
        self.queues: dict[str, Any] = {}
        self.ladder: Any = None
        reg.register(_QueueCollector(self))
        self.degrade_changes = Counter("tiergate_degrade_changes", "Degradation level changes.", ["to", "by"],
                                       registry=reg)
        # tiers with versions (gateway/rollout): each version's own traffic, and what a shadow sends the candidate
        self.rollouts: Any = None
        reg.register(_RolloutCollector(self))
        self.version_requests = Counter("tiergate_version_requests",
                                        "Requests a tier's version answered, by result (ok, error: a 5xx).",
                                        ["tier", "version", "result"], registry=reg)
        self.version_ttft = Histogram("tiergate_version_time_to_first_token_seconds",
                                      "Arrival to first output token, per version of a tier.", ["tier", "version"],
                                      buckets=LATENCY_BUCKETS, registry=reg)
        self.rollout_shadow = Counter("tiergate_rollout_shadow_requests",
                                      "Requests a shadow copied to the candidate, by result (ok, error, dropped: "
                                      "over the limit in flight).", ["tier", "version", "result"], registry=reg)
        self.rollout_shadow_cost = Counter("tiergate_rollout_shadow_cost_usd",
                                           "What shadow calls cost us in compute, USD (never billed).",
                                           ["tier", "version"], registry=reg)

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus-client checks and formats the labels at every call (~2 µs),
        and a request touches a dozen. As many entries as the registry's own children (none is ever removed)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def finished(self, row: LedgerRow, overhead_s: float | None, *, billed: bool = True) -> None:
        """A finished request: its count and latencies; what it bills too, unless `billed` is False (the caller
        counts that with `billed` once its ledger row is durable)."""
        tier = row.tier or "none"
        child = self.child
        child(self.requests, row.tenant, tier, row.status).inc()
        if billed:
            self.billed(row)
        if row.ttft_s is not None:
            child(self.ttft, tier).observe(row.ttft_s)
            if row.output_tokens > 1:
                child(self.tpot, tier).observe((row.total_s - row.ttft_s) / (row.output_tokens - 1))
        child(self.total, tier).observe(row.total_s)
        if overhead_s is not None:
            self.overhead.observe(max(0.0, overhead_s))

    def billed(self, row: LedgerRow) -> None:
        """What `row` bills (tokens, price, compute cost, savings): the ledger's, counted once the row is in it, so the
        counters never hold a row withdrawn or refused (gateway/pipeline/settle.py)."""
        tier = row.tier or "none"
        child = self.child
        child(self.tokens, row.tenant, tier, "input").inc(row.input_tokens)
        child(self.tokens, row.tenant, tier, "output").inc(row.output_tokens)
        child(self.price, row.tenant, tier).inc(float(row.price_usd))
        child(self.compute_cost, row.tenant, tier).inc(float(row.compute_cost_usd))
        if row.route_saving_usd > 0:
            child(self.route_savings, row.tenant).inc(float(row.route_saving_usd))
        if row.cache_saving_usd > 0:
            child(self.cache_savings, row.tenant).inc(float(row.cache_saving_usd))

    def billed_when_written(self, row: LedgerRow, written: asyncio.Future[None]) -> None:
        """`billed(row)` once its ledger future (`written`) says it is durable; never if it was withdrawn or refused."""
        def count(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                try:
                    self.billed(row)
                except Exception:  # a metric is not worth a traceback on the loop
                    log.exception("counting the bill of request %s failed", row.request_id)

        if written.done():
            count(written)
        else:
            written.add_done_callback(count)

    def version_finished(self, tier: str, version: str, *, failed: bool, ttft_s: float | None) -> None:
        self.version_requests.labels(tier, version, "error" if failed else "ok").inc()
        if ttft_s is not None:
            self.version_ttft.labels(tier, version).observe(ttft_s)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def degrade_changed(self, event: Any) -> None:
        self.degrade_changes.labels(str(event.to_level), "auto" if event.who == "auto" else "manual").inc()

    def redis_state(self, up: bool) -> None:
        self.redis_up.set(1 if up else 0)
        self.redis_transitions.labels("up" if up else "down").inc()

    def render(self) -> bytes:
        """The registry's text, as prometheus-client writes it (gateway/metrics_text.py: at a fraction of the cost)."""
        return self._text.render()
