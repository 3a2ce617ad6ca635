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
    """conversation key → (tier, replica index) that last served it, per tenant, at most `max_entries` in all.

    Shared fairly: when full, the tenant holding the most entries (the one furthest over its fair share, the map's
    size over the tenants in it) loses its own least recently used one. Of tenants holding equally many, the one
    remembering pays if it is among them, else the one that got to that many first. So a flood recycles only the
    flooder's own entries, and a tenant that went over its share while the map was quiet gives back to tenants that
    come later, however warm its entries are (the least recently used entry of the whole map went before: a tenant
    keeping its own warm kept them all while later tenants evicted each other). Finding that tenant costs O(1):
    tenants sit in buckets by how many entries they hold, and one operation moves a count, and so the largest, by one.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._num_entries = 0
        self._by_tenant: dict[str, OrderedDict[str, tuple[str, int]]] = {}  # tenant -> key -> (tier, index), LRU first
        self._holding: dict[int, dict[str, None]] = {}  # n -> tenants holding n entries, in the order they got there
        self._max_held = 0  # the largest n in _holding; 0 when the map is empty

    def __len__(self) -> int:
        return self._num_entries

    def held_by(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def get(self, key: str, tier: str, tenant: str = "") -> int | None:
        own = self._by_tenant.get(tenant)
        hit = own.get(key) if own is not None else None
        if own is None or hit is None or hit[0] != tier:
            return None
        own.move_to_end(key)
        return hit[1]

    def remember(self, key: str, tier: str, index: int, tenant: str = "") -> None:
        own = self._by_tenant.setdefault(tenant, OrderedDict())
        fresh = key not in own
        own[key] = (tier, index)
        own.move_to_end(key)
        if not fresh:
            return
        self._num_entries += 1
        self._count_moved(tenant, len(own) - 1)
        if self._num_entries > self.max_entries:
            self._evict(tenant)

    def _evict(self, remembering: str) -> None:
        """The least recently used entry of the tenant holding the most; `remembering` pays on a tie, unless all it
        holds is the entry it is remembering now."""
        held = len(self._by_tenant[remembering])
        victim = remembering if held == self._max_held and held > 1 else next(iter(self._holding[self._max_held]))
        own = self._by_tenant[victim]
        own.popitem(last=False)
        self._num_entries -= 1
        if not own:
            del self._by_tenant[victim]
        self._count_moved(victim, len(own) + 1)

    def _count_moved(self, tenant: str, was: int) -> None:
        """`tenant` held `was` entries and now holds one more or one fewer: move it to its new bucket."""
        now = len(self._by_tenant.get(tenant, ()))
        if was:
            bucket = self._holding[was]
            del bucket[tenant]
            if not bucket:
                del self._holding[was]
                if was == self._max_held:
                    self._max_held = now  # it was the last one at the top: the top is where it went
        if now:
            self._holding.setdefault(now, {})[tenant] = None
            self._max_held = max(self._max_held, now)


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
