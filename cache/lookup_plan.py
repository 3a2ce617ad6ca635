"""A cacheable request's lookup between its steps (`LookupPlan`), and the TTL rule every step applies.

`SemanticCache` runs a lookup in steps, some on the event loop and some in worker threads (cache/lookup_pass.py):
policy and the in-memory exact check, the store's exact probe, the embedding, the semantic search. The plan is what
one step hands the next: the scope, the tenant's policy, the request, the time the lookup began (every step judges
expiry at that one instant), and the keys, hashed once and only as far as a step needs them. A missed lookup hands
its keys on to the store of the answer (`probe`), so they are not hashed twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cache.request_key import RequestKey, exact_key, request_key
from cache.results import Probe, TenantPolicy
from cache.scope import CacheScope
from cache.store import Entry


def within_ttl(entry: Entry, policy: TenantPolicy, now: float) -> bool:
    """Whether `entry` is younger than the tenant's TTL now. An entry's own expiry is its TTL when it was stored: a
    plan whose `ttl_s` was lowered since (or set, where it had none) serves nothing older than its new TTL, though
    the entry stays (a plan changed back serves it again) until its own expiry or eviction."""
    return policy.ttl_s is None or entry.created_at + policy.ttl_s > now


class LookupPlan:
    """A cacheable request's lookup, between its steps."""

    __slots__ = ("_key", "exact_key", "now", "policy", "request", "scope", "scope_id")

    def __init__(self, scope: CacheScope, policy: TenantPolicy, request: Mapping[str, Any], now: float,
                 exact: str | None = None, scope_id: str | None = None):
        """`exact`, `scope_id`: the request's `exact_key` and the scope's `scope_id`, where the caller has them."""
        self.scope, self.policy, self.request, self.now = scope, policy, request, now
        # a hash of the scope's fields: computed once for the lookup's steps
        self.scope_id = scope.scope_id if scope_id is None else scope_id
        self.exact_key = exact_key(request) if exact is None else exact
        self._key: RequestKey | None = None

    @property
    def key(self) -> RequestKey:
        """Every key of the request, its history hash too: hashed on first use, past the exact layer (an exact hit
        in this process's memory, the fast path, needs the exact key alone)."""
        if self._key is None:
            self._key = request_key(self.request, self.exact_key)
        return self._key

    @property
    def partition(self) -> str:
        return f"{self.scope_id}:{self.key.history_hash}"

    def probe(self, vector: np.ndarray | None = None) -> Probe:
        return Probe(self.key, self.partition, vector)
