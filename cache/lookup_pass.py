"""The lookup's pass once its policy and keys are known (`LookupPlan`): this process's answers, the store's exact
entry, then the semantic layer. `SemanticCache` (cache/semantic_cache.py) runs the steps, each handed the plan (and
the vector) and answering a result, or None (or the plan) to go on.

A lookup goes: tenant policy and cacheability (`request_key.decide`) -> exact layer (the scope and the
whole conversation as sent: first this process's answers still being written or written and read lately
(`cache.recent`), then the store) -> semantic layer (embed the last user turn, NFKC with collapsed whitespace
(`request_key.embedding_text`), if it is short enough to be compared whole, `SEMANTIC_MAX_CHARS`; search the faiss
partition of its scope and history, take (cache/candidates.py) the nearest candidates above the tenant's threshold
and within `fallback_margin` of the nearest, and serve the first one the near-miss guards accept (they read both
turns as sent, so "2³" is not "23" to them, nor an indented line an unindented one, though both pairs embed alike)
and, for a plan with `meaning_check`, the meaning check too, on the texts as the guards read them
(`guards.comparable`): cache/meaning_check.py, one forward pass for each such candidate). Every result says why, so
the gateway can put it in `x-tiergate-cache` and in metrics.

Locks: one tenant's writes must never stall another tenant's lookups. A lookup's faiss search takes no lock
of this class, only its own partition's, briefly; a partition's rebuild (a quarter of it dead, or the switch
to HNSW; seconds at 25k entries) runs in the index's builder thread with no lock a search takes
(cache/index.py), so no write holds any lock through a rebuild. `EntryWriter.lock` orders a write's store put,
index update and pending-entry bookkeeping against purges and version bumps (a lookup takes it only to delete
an expired entry, a short write like any other). The search needs no part of it: the
store is the truth and the index only proposes candidates; a candidate the store no longer has is skipped, an
entry removed from the index is never proposed once `remove` returns, and one added is proposed once `add`
returns, which is before `EntryWriter.write` returns (read your own writes).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from cache import guards
from cache.candidates import screen
from cache.change_feed import ChangeFeed
from cache.entry_writes import EntryWriter
from cache.error_bound import TenantBounds
from cache.index import PartitionedIndex
from cache.lookup_plan import LookupPlan, within_ttl
from cache.meaning_check import MeaningCheck
from cache.meaning_gate import MEANING_DIFFERS, first_accepted
from cache.pending import PendingWrites
from cache.recent import RecentEntries
from cache.results import CacheStats, Hit, LookupResult, Miss, Near, Probe
from cache.store import CacheStore, Entry

# The refusal (stats.refused, tiergate_cache_refused_candidates_total) of a candidate the index proposed under a
# partition the store files it under no longer, or never did: a fault, never served (`_servable`).
WRONG_PARTITION = "entry of another partition"

# The cache's own logger (its messages keep the name they are filtered by).
log = logging.getLogger("cache.semantic_cache")


class LookupPass:
    """The steps of a lookup after its policy, over the cache's store, writer and maps (shared with the store of
    answers), with the knobs of the semantic layer (`SemanticCache` reads and sets them through `OnPass`)."""

    def __init__(self, entries: CacheStore, writes: EntryWriter, feed: ChangeFeed, pending: PendingWrites,
                 recent: RecentEntries, stats: CacheStats, sync_step: Callable[[], tuple[int, bool]], *,
                 meaning: MeaningCheck, top_k: int, fallback_margin: float, bounds: TenantBounds,
                 rng: random.Random):
        """`sync_step`: one job of the writer thread's catch-up (`SemanticCache._sync_step`), queued by a lookup
        that finds one due."""
        self.entries, self.writes, self.feed = entries, writes, feed
        self.pending, self.recent, self.stats = pending, recent, stats
        self._sync_step = sync_step
        self.meaning = meaning
        self.top_k = top_k
        # Candidates after the nearest are tried only this close to it: when the nearest entry is refused by
        # the guards, a much farther one that passes is more often another question than the same one.
        self.fallback_margin = fallback_margin
        self.bounds = bounds  # each tenant's learned semantic threshold (cache/error_bound.py)
        self.rng = rng  # which semantic hits are checked (seed it for a repeatable run)

    @property
    def index(self) -> PartitionedIndex:
        """The writer's faiss partitions (replaced whole when the change log was cut past this process)."""
        return self.writes.index

    def in_memory(self, plan: LookupPlan) -> LookupResult | LookupPlan:
        """An answer this process has not finished writing (or wrote and read lately) as an exact hit, or the plan
        to go on with. No I/O."""
        entry = self.pending.get(plan.scope_id, plan.exact_key)
        if entry is None and self.feed.recent():
            entry = self.recent.get(plan.scope_id, plan.exact_key, plan.now)  # deletions elsewhere applied
        if entry is not None and (entry.expires_at is None or entry.expires_at > plan.now) \
                and within_ttl(entry, plan.policy, plan.now):
            self.stats.exact_hits += 1
            return Hit(entry, "exact", 1.0)
        return plan

    def exact(self, plan: LookupPlan) -> LookupResult | None:
        """The store's exact entry, or a miss when there is nothing to compare by meaning; None: go semantic."""
        if self.feed.due():  # queued for the writer thread: this lookup never pays for other processes' writes
            self.writes.sync_soon(self._sync_step)
        seen = self.recent.generation  # before the read: a deletion applied after it keeps the entry out of `recent`
        entry = self.entries.find_exact(plan.scope_id, plan.exact_key)
        if entry is not None and self.writes.alive(entry, plan.now) and within_ttl(entry, plan.policy, plan.now):
            self.entries.touch(entry.entry_id, plan.now)
            self.writes.checkpoint_soon()
            self.recent.put(entry, seen=seen)
            self.stats.exact_hits += 1
            return Hit(entry, "exact", 1.0)
        if not (plan.policy.semantic and self.index.partition_size(plan.partition)):
            return self.miss("no entry", probe=plan.probe())  # nothing to compare with: no embedding
        return None

    def semantic(self, plan: LookupPlan, vector: np.ndarray | None) -> LookupResult:
        """The semantic layer's answer for the last user turn's `vector` (None: not compared by meaning)."""
        if vector is None:
            # no text compared by meaning (request_key.compared_text: too long, several parts, a raw prompt)
            reason = "no entry (too long to match by meaning)" if plan.key.last_user_text else "no entry"
            return self.miss(reason, probe=plan.probe())
        candidates = self.index.search(plan.partition, vector, self.top_k)  # no lock of the writer: see the docstring
        if not candidates:
            return self.miss("no entry", probe=plan.probe(vector))
        policy = plan.policy
        bound = self.bounds.get(plan.scope.tenant, policy.max_error_rate, policy.similarity_threshold,
                                meaning_check=policy.meaning_check)
        threshold = policy.similarity_threshold if bound is None else bound.threshold(policy.similarity_threshold)
        threshold += policy.threshold_delta
        floor = threshold if bound is None else min(threshold, bound.floor)  # near misses to label, down to here
        found = screen(candidates, plan.key.last_user_text, threshold=threshold, floor=floor,
                       fallback_margin=self.fallback_margin, meaning_check=policy.meaning_check,
                       tenant=plan.scope.tenant, user=plan.scope.end_user, fetch=partial(self._servable, plan),
                       checked=partial(self.checked, plan), refused=self.stats.refused)
        servable, refusal = found.servable, found.refusal
        if servable:
            chosen, reason = self.checked(plan, servable)
            if chosen is not None:
                entry, similarity = chosen
                self.entries.touch(entry.entry_id, plan.now)
                self.writes.checkpoint_soon()
                self.stats.semantic_hits += 1
                sampled = bound is not None and self.rng.random() < policy.shadow_rate
                return Hit(entry, "semantic", similarity, shadow_rate=policy.shadow_rate if sampled else 0.0)
            refusal = f"refused near miss: {reason}" + (f" ({servable[0][1]:.3f})" if reason == MEANING_DIFFERS
                                                         else "")
        return self.miss(refusal, candidates[0][1], probe=plan.probe(vector), near=found.near)

    def _servable(self, plan: LookupPlan, entry_id: str) -> Entry | None:
        """The stored entry `entry_id` if the lookup may serve it (not deleted, not expired, within the TTL, and
        filed under the lookup's partition: its scope and history)."""
        entry = self.entries.get(entry_id)
        if entry is None:
            return None
        if entry.partition != plan.partition:  # the index's word alone is not the scope check; no path is known
            self._wrong_partition(entry_id)
            return None
        if not self.writes.alive(entry, plan.now) or not within_ttl(entry, plan.policy, plan.now):
            return None
        return entry

    def _wrong_partition(self, entry_id: str) -> None:
        """Count a candidate of another partition (every one) and log the first this process meets."""
        self.stats.refused[WRONG_PARTITION] += 1
        if self.stats.refused[WRONG_PARTITION] == 1:
            log.error("semantic cache: the index proposed entry %s, which the store files under another partition "
                      "(not served; counted as %r, not logged again)", entry_id, WRONG_PARTITION)

    def checked(self, plan: LookupPlan,
                candidates: list[tuple[Entry, float]]) -> tuple[tuple[Entry, float] | None, str]:
        """The candidate to serve: the first, or under the plan's meaning check the first it accepts (and why none
        was), cache/meaning_gate.py."""
        if not plan.policy.meaning_check:
            return candidates[0], ""
        owner, user = plan.scope.tenant, plan.scope.end_user  # whose memo of what texts read as (cache/guards.py)
        return first_accepted(self.meaning, guards.comparable(plan.key.last_user_text, owner, user),
                              [(guards.comparable(c[0].semantic_text, owner, user), c) for c in candidates],
                              scope=plan.scope_id, owner=plan.scope.tenant, refused=self.stats.refused)

    def miss(self, reason: str, best: float | None = None, *, probe: Probe | None = None,
             near: Near | None = None) -> Miss:
        self.stats.misses += 1
        return Miss(reason, best, probe=probe, near=near)


class OnPass:
    """An attribute of `SemanticCache` kept on its `LookupPass` (`lookups`), read and set on the cache as before
    (tools and tests tune the cache's `meaning`, `fallback_margin`, `rng`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cache: Any, owner: type | None = None) -> Any:
        return self if cache is None else getattr(cache.lookups, self.name)

    def __set__(self, cache: Any, value: Any) -> None:
        setattr(cache.lookups, self.name, value)
