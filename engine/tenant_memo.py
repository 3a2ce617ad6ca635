"""Recent values per tenant: one LRU per tenant, tenants in LRU order (the engine's grammar cache, engine/grammar.py).

A memo shared by every tenant lets one time its own requests and learn what another asked lately (a remembered value
is faster), and lets one tenant's flood evict everyone's values. Here each tenant's values are evicted only by its own
(`per_tenant`), and whole memos by the `tenants` most recently active tenants: at most per_tenant x tenants values.
Not thread-safe: callers lock.

The same as cache/owner_memo.py's OwnerMemo, which the engine cannot import: it knows no package above it (DESIGN.md,
"The path of one request"), and importing `cache` loads its whole package (redis, the embedder: 0.4 s).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class TenantMemo(Generic[V]):
    def __init__(self, per_tenant: int, tenants: int) -> None:
        self.per_tenant, self.tenants = per_tenant, tenants
        self._memos: OrderedDict[Hashable, OrderedDict[Hashable, V]] = OrderedDict()

    def get(self, tenant: Hashable, key: Hashable) -> V | None:
        memo = self._memos.get(tenant)
        value = memo.get(key) if memo is not None else None
        if value is not None:
            memo.move_to_end(key)  # type: ignore[union-attr]
            self._memos.move_to_end(tenant)
        return value

    def put(self, tenant: Hashable, key: Hashable, value: V) -> None:
        memo = self._memos.get(tenant)
        if memo is None:
            memo = self._memos[tenant] = OrderedDict()
            while len(self._memos) > self.tenants:
                self._memos.popitem(last=False)
        self._memos.move_to_end(tenant)
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > self.per_tenant:
            memo.popitem(last=False)
