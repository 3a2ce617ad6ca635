"""Which replica of a tier takes a request: the one holding its conversation's prefix, else the least loaded.

A follow-up turn repeats its conversation's earlier messages, so the replica that served the earlier turn
has that prefix in its KV cache (our engine shares prefix blocks; vLLM and SGLang do the same) and starts
decoding sooner. The conversation is recognised by a hash of the tenant and its first messages (the
system prompt and the first user turn), which every later turn repeats unchanged; a client may also name
its session in the `x-tiergate-session` header. The map is a bounded LRU: forgetting an old conversation
costs one cold prefill, never a wrong answer; it is shared fairly between tenants (AffinityMap).

Without affinity (a new conversation, or its replica cannot take requests now), the replica with the
least predicted wait wins: requests in flight there times its smoothed latency.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from tiers.replica import Replica

SESSION_HEADER = "x-tiergate-session"
DEFAULT_LATENCY_S = 1.0  # assumed per request until some replica of the tier has finished one


def affinity_key(tenant: str, messages: Sequence[Mapping[str, object]], session: str | None = None) -> str:
    """The conversation's identity: the explicit session, else tenant + messages up to the first user turn."""
    h = hashlib.blake2b(digest_size=16)
    h.update(tenant.encode())
    if session:
        h.update(b"\x00session\x00" + session.encode())
        return h.hexdigest()
    for m in messages:
        h.update(b"\x00" + str(m.get("role")).encode() + b"\x01" + str(m.get("content") or "").encode())
        if m.get("role") == "user":
            break
    return h.hexdigest()


class AffinityMap:
    """conversation key → (tier, replica index) that last served it, per tenant; when full, the least recently used
    entry goes, unless the tenant remembering one holds more than its fair share (the map's size over the tenants
    in it): then its own least recently used goes. One tenant's new conversations once cost everyone theirs: 100,000
    of them left another tenant 0 of its 1,000 (a test harness); now a flood only recycles the flooder's own."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._lru: OrderedDict[tuple[str, str], tuple[str, int]] = OrderedDict()  # (tenant, key) -> (tier, index)
        self._per_tenant: dict[str, OrderedDict[str, None]] = {}  # tenant -> its keys, least recently used first

    def __len__(self) -> int:
        return len(self._lru)

    def held_by(self, tenant: str) -> int:
        return len(self._per_tenant.get(tenant, ()))

    def get(self, key: str, tier: str, tenant: str = "") -> int | None:
        hit = self._lru.get((tenant, key))
        if hit is None or hit[0] != tier:
            return None
        self._touch(tenant, key)
        return hit[1]

    def remember(self, key: str, tier: str, index: int, tenant: str = "") -> None:
        fresh = (tenant, key) not in self._lru
        self._lru[tenant, key] = (tier, index)
        self._per_tenant.setdefault(tenant, OrderedDict())[key] = None
        self._touch(tenant, key)
        if fresh and len(self._lru) > self.max_entries:
            own = self._per_tenant[tenant]
            if len(own) > self.max_entries / len(self._per_tenant):  # over its share: it pays with its own
                self._forget(tenant, next(iter(own)))
            else:
                self._forget(*next(iter(self._lru)))

    def _touch(self, tenant: str, key: str) -> None:
        self._lru.move_to_end((tenant, key))
        self._per_tenant[tenant].move_to_end(key)

    def _forget(self, tenant: str, key: str) -> None:
        del self._lru[tenant, key]
        own = self._per_tenant[tenant]
        del own[key]
        if not own:
            del self._per_tenant[tenant]


def choose_replica(replicas: Iterable[Replica], *, exclude: set[int] | None = None,
                   preferred: int | None = None) -> tuple[Replica | None, str]:
    """The replica to call and why; (None, why) when none can take a request (unhealthy or breaker open)."""
    candidates = [r for r in replicas if r.index not in (exclude or set())]
    usable = [r for r in candidates if r.can_take]
    if not usable:
        return None, _why_none(candidates)
    if preferred is not None:
        for r in usable:
            if r.index == preferred:
                return r, "affinity"
    measured = [r.latency_ewma_s for r in usable if r.latency_ewma_s is not None]
    typical = sum(measured) / len(measured) if measured else DEFAULT_LATENCY_S
    best = min(usable, key=lambda r: (r.predicted_wait_s(typical), r.inflight, r.index))
    return best, "least predicted wait"


def _why_none(candidates: list[Replica]) -> str:
    if not candidates:
        return "no replica left to try"
    parts = []
    for r in candidates:
        if not r.healthy:
            parts.append(f"replica {r.index} {r.status} ({r.reason})" if r.reason else f"replica {r.index} {r.status}")
        else:
            parts.append(f"replica {r.index} circuit {r.breaker.state}")
    return "; ".join(parts)
