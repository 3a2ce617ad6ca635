"""A rollout window's bounded store of outcomes, shared out by tenant (gateway/rollout/guards.py's `Window`).

At most `bound` items, each in its tenant's ring. Past the bound, the tenant holding the most gives up its oldest:
one tenant's flood pushes out its own outcomes, never the others' (which the guards need to hold its breach: a shared
ring of the newest left only the flooder's, and it judged alone). Among rings alike in size, the oldest ring's (the
one made first) gives way.

Appending runs on the event loop for every request a rollout sees, so it must not cost one step per tenant: a
hostile mix of up to `bound` tenants, each below the average share, made every append a scan of them all. The
largest ring is read from a max-heap of (-size, ring's serial, tenant) instead. The heap is lazy: an entry is pushed
whenever a ring's size changes, and one whose ring has since changed size or gone is dropped when it reaches the
top; when stale entries outnumber the rings, the heap is rebuilt from the rings. So an append costs one heap push
(log of the heap's size, at most about 2 x bound entries), and the stale pops and rebuilds are paid for by the
pushes that made them (amortised O(1) each).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, TypeVar

Tenant = str | None  # whose request an outcome was; None: the gateway's own observation (a candidate found down)
T = TypeVar("T")
SLACK = 64  # stale heap entries tolerated beyond one per ring before a rebuild


class _Ring(deque[T]):
    """One tenant's items, oldest first, with the serial that ranks it among rings of the same size."""

    __slots__ = ("serial",)

    def __init__(self, serial: int) -> None:
        super().__init__()
        self.serial = serial


class Rings(Generic[T]):
    """At most `bound` items, each in its tenant's ring; past the bound, the largest ring gives up its oldest (the
    module's docstring says why). A tenant holding more than the average gives up its own without the heap."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._rings: dict[Tenant, _Ring[T]] = {}  # in the order they were made: `items` reads them so
        self._size = 0
        self._made = 0  # rings made so far: the next one's serial
        self._heap: list[tuple[int, int, Tenant]] = []  # (-size, serial, tenant); serials are unique

    def append(self, tenant: Tenant, item: T) -> None:
        ring = self._rings.get(tenant)
        if ring is None:
            ring = self._rings[tenant] = _Ring(self._made)
            self._made += 1
        ring.append(item)
        self._size += 1
        if self._size > self.bound and len(ring) * len(self._rings) > self._size:
            ring.popleft()  # above the average: its own oldest goes, and its size is what the heap has
            self._size -= 1
            return
        self._push(tenant, ring)
        if self._size > self.bound:
            self._evict()

    def items(self) -> list[T]:
        """Every item (list(): C-level copies, safe off the loop while `append` runs on it)."""
        return [item for ring in list(self._rings.values()) for item in list(ring)]

    def _push(self, tenant: Tenant, ring: _Ring[T]) -> None:
        if len(self._heap) > 2 * len(self._rings) + SLACK:  # mostly stale: rebuilt, O(rings) once per as many pushes
            self._heap = [(-len(r), r.serial, t) for t, r in self._rings.items()]
            heapq.heapify(self._heap)
        else:
            heapq.heappush(self._heap, (-len(ring), ring.serial, tenant))

    def _evict(self) -> None:
        """The largest ring (the oldest among equals) gives up its oldest item."""
        heap = self._heap
        while True:
            negative, serial, owner = heap[0]
            ring = self._rings.get(owner)
            if ring is not None and ring.serial == serial and len(ring) == -negative:
                break
            heapq.heappop(heap)  # stale: that ring changed size, or went, since
        ring.popleft()
        self._size -= 1
        if ring:
            heapq.heapreplace(heap, (-len(ring), serial, owner))
        else:
            heapq.heappop(heap)
            del self._rings[owner]
