"""What each tenant's cache error bound says (cache/error_bound.py), read at scrape time.

`tiergate_cache_semantic_threshold` is the similarity a semantic candidate must reach now (+Inf: the evidence
admits no semantic hit; absent: too few labels yet, the plan's static threshold decides);
`tiergate_cache_estimated_error` the weighted share of shadow-checked semantic hits that were wrong, next to
`tiergate_cache_max_error_rate`, the plan's bound, to alert on. The hit rate is
`tiergate_cache_requests{result="hit"}` over all of a tenant's lookups. Each gateway process learns its own
bound from the traffic it serves; with several workers a scrape shows the answering worker's.

`tiergate_cache_refused_candidates_total{reason}` counts semantic candidates refused by the near-miss guards
("numbers differ", ...) and the meaning check ("meaning differs"; "meaning check busy" and "meaning check
unavailable" are the ones to alert on), this process's since it started.

`tiergate_cache_index_loaded` is 0 while the cache's index has not been loaded from its store (a gateway started
during a Redis outage: lookups miss until the first catch-up that works loads it), 1 once it is.

`tiergate_cache_dropped_writes_total{tenant}` counts a tenant's new answers not written to the cache because it
had `writes_queued_per_tenant` writes waiting for the cache's writer already (its oldest waiting one goes;
cache/tenant_writes.py): a flood of new answers, which costs that tenant later misses and no one else anything.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cache import SemanticCache


class CacheBoundCollector:
    def __init__(self, cache: SemanticCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        threshold = GaugeMetricFamily("tiergate_cache_semantic_threshold",
                                      "Learned similarity a semantic hit must reach (+Inf: none allowed now).",
                                      labels=["tenant"])
        error = GaugeMetricFamily("tiergate_cache_estimated_error",
                                  "Share of shadow-checked semantic hits that were wrong (weighted).",
                                  labels=["tenant"])
        bound = GaugeMetricFamily("tiergate_cache_max_error_rate", "The plan's bound on wrong semantic hits.",
                                  labels=["tenant"])
        labels = GaugeMetricFamily("tiergate_cache_bound_labels", "Labelled candidates the bound learns from.",
                                   labels=["tenant"])
        for tenant, state in sorted(self.cache.bounds.states().items()):
            if state.threshold is not None:
                threshold.add_metric([tenant], state.threshold)
            if state.estimated_error is not None:
                error.add_metric([tenant], state.estimated_error)
            bound.add_metric([tenant], state.max_error_rate)
            labels.add_metric([tenant], state.labels)
        refused = CounterMetricFamily("tiergate_cache_refused_candidates",
                                      "Semantic candidates refused by the guards or the meaning check, by reason.",
                                      labels=["reason"])
        for reason, count in sorted(dict(self.cache.stats.refused).items()):
            refused.add_metric([reason], count)
        dropped = CounterMetricFamily("tiergate_cache_dropped_writes",
                                      "New answers not written to the cache: their tenant's write queue was full.",
                                      labels=["tenant"])
        for tenant, count in sorted(dict(self.cache.stats.dropped_writes).items()):
            dropped.add_metric([tenant], count)
        loaded = GaugeMetricFamily("tiergate_cache_index_loaded",
                                   "1: the cache's index is loaded from its store; 0: not yet (started while it "
                                   "did not answer).")
        loaded.add_metric([], 1.0 if self.cache.loaded else 0.0)
        yield from (threshold, error, bound, labels, refused, dropped, loaded)
