"""Which cached entries are stale by version, and which of them `SemanticCache.reclaim` deletes next.

A scope carries the tenant's data version and the tier's model version, so a bumped or retired version makes
the older entries unreachable at once; these rules say which of them may be deleted, and which late writes are
dropped: an answer still being written when its tenant's data was bumped was answered from the replaced data.

- data: tenant -> (the current data version, when it was bumped). Entries created before the bump at any other
  version are stale; entries created later are kept whatever their version (a version may combine the counter
  with a per-request header). A rule is dropped once the store holds nothing it names.
- models: retired model versions (no tier serves them any more: its weights, quantization or engine changed, or a
  rollout moved it to another version); their entries are stale, and a late write of one is dropped. A version
  served again is no longer retired. Its reclaim ends once the store holds none of it (each write's reclaim would
  otherwise scan the store for it for ever).

Thread-safe; the store is asked only outside the lock.
"""

from __future__ import annotations

import threading

from cache.store import CacheStore, Entry


class StaleVersions:
    """The bumped data versions and retired model versions whose entries are still to be reclaimed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[str, float]] = {}  # tenant -> (current data version, bumped at)
        self._models: set[str] = set()  # retired: their late writes are dropped
        self._reclaiming: set[str] = set()  # retired ones the store may still hold entries of

    def bump_data(self, tenant: str, current: str, bumped_at: float) -> None:
        with self._lock:
            self._data[tenant] = (current, bumped_at)

    def retire_model(self, model_version: str) -> None:
        with self._lock:
            self._models.add(model_version)
            self._reclaiming.add(model_version)

    def serve_model(self, model_version: str) -> None:
        """A model version is served again (a rollback): its new answers are kept."""
        with self._lock:
            self._models.discard(model_version)
            self._reclaiming.discard(model_version)

    def written_too_late(self, entry: Entry) -> bool:
        """True for an answer created before its tenant's data was bumped past its version, or of a retired model
        version (a request that was still running when its tier stopped serving it)."""
        with self._lock:
            rule = self._data.get(entry.tenant)
            retired = entry.model_version in self._models
        return retired or (rule is not None and entry.data_version != rule[0] and entry.created_at < rule[1])

    def to_reclaim(self, store: CacheStore, now: float, limit: int) -> list[str]:
        """Up to `limit` ids: expired entries first, then those of bumped data and of retired model versions."""
        ids = store.expired(now, limit)
        with self._lock:
            data_rules, model_versions = list(self._data.items()), list(self._reclaiming)
        for tenant, rule in data_rules:
            if len(ids) >= limit:
                break
            found = store.ids_not_at_data_version(tenant, rule[0], rule[1], limit - len(ids))
            ids += found
            if not found:
                with self._lock:
                    if self._data.get(tenant) == rule:  # not bumped again meanwhile
                        del self._data[tenant]
        for model_version in model_versions:
            if len(ids) >= limit:
                break
            found = store.ids_of_model_version(model_version, limit - len(ids))
            ids += found
            if not found:
                with self._lock:
                    self._reclaiming.discard(model_version)
        return ids
