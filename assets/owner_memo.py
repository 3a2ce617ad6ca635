"""Recent values per owner (a tenant): one LRU per owner, owners in LRU order.

Used by the engine's grammar cache (engine/grammar.py) and by the cache's meaning-check and embedding memos
(cache/meaning_check.py, cache/vectors.py). It lives in `assets/`, the one package below both that either may import
(tests/test_import_rules.py: the engine imports only `wire/` and `assets/`, and `cache/` never the engine).

A memo shared by every tenant lets one time its own requests and learn what another asked lately (a remembered
value is faster), and lets one tenant's flood evict everyone's values. Here each owner's values are evicted only by
its own (`per_owner`), and whole memos by the `owners` most recently active owners. Where `total` bounds the values
of all owners together, past it the least recently active owner's oldest value goes (an owner may then hold up to
`per_owner` alone: a busy tenant is not cut to total / owners). Not thread-safe: callers lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class OwnerMemo(Generic[V]):
    def __init__(self, per_owner: int, owners: int, total: int | None = None) -> None:
        self.per_owner, self.owners, self.total = per_owner, owners, total
        self._memos: OrderedDict[Hashable, OrderedDict[Hashable, V]] = OrderedDict()
        self._size = 0  # values held, all owners together

    def get(self, owner: Hashable, key: Hashable) -> V | None:
        memo = self._memos.get(owner)
        value = memo.get(key) if memo is not None else None
        if value is not None:
            memo.move_to_end(key)  # type: ignore[union-attr]
            self._memos.move_to_end(owner)
        return value

    def put(self, owner: Hashable, key: Hashable, value: V) -> None:
        memo = self._memos.get(owner)
        if memo is None:
            memo = self._memos[owner] = OrderedDict()
            while len(self._memos) > self.owners:
                self._size -= len(self._memos.popitem(last=False)[1])
        self._memos.move_to_end(owner)
        self._size += key not in memo
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > self.per_owner:
            memo.popitem(last=False)
            self._size -= 1
        while self.total is not None and self._size > self.total:
            oldest_owner, oldest = next(iter(self._memos.items()))
            oldest.popitem(last=False)
            self._size -= 1
            if not oldest:
                del self._memos[oldest_owner]

    def pop(self, owner: Hashable, key: Hashable) -> V | None:
        """Forget `owner`'s value of `key`; the value, or None if none was kept."""
        memo = self._memos.get(owner)
        if memo is None or key not in memo:
            return None
        self._size -= 1
        return memo.pop(key)
