"""Which cached entries are stale by version, and which of them `SemanticCache.reclaim` deletes next.

A scope carries the tenant's data version and the tier's model version, so a bumped or retired version makes
the older entries unreachable at once; these rules say which of them may be deleted, and which late writes are
dropped: an answer still being written when its tenant's data was bumped was answered from the replaced data.

- data: tenant -> (the current data version, when it was bumped). Entries created before the bump at any other
  version are stale; entries created later are kept whatever their version (a version may combine the counter
  with a per-request header). A rule is dropped once the store holds nothing it names.
- models: retired model versions (a tier's weights, quantization or engine changed); their entries are stale.

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
        self._models: set[str] = set()

    def bump_data(self, tenant: str, current: str, bumped_at: float) -> None:
        with self._lock:
            self._data[tenant] = (current, bumped_at)

    def retire_model(self, model_version: str) -> None:
        with self._lock:
            self._models.add(model_version)

    def written_too_late(self, entry: Entry) -> bool:
        """True for an answer created before its tenant's data was bumped past its version."""
        with self._lock:
            rule = self._data.get(entry.tenant)
        return rule is not None and entry.data_version != rule[0] and entry.created_at < rule[1]

    def to_reclaim(self, store: CacheStore, now: float, limit: int) -> list[str]:
        """Up to `limit` ids: expired entries first, then those of bumped data and of retired model versions."""
        ids = store.expired(now, limit)
        with self._lock:
            data_rules, model_versions = list(self._data.items()), list(self._models)
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
            ids += store.ids_of_model_version(model_version, limit - len(ids))
        return ids
