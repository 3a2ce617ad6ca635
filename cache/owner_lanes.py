"""Jobs queued per owner (a tenant), the owners served in turns: one lane per owner, first in first out.

`take` gives the oldest job of the owner whose turn it is, then sends that owner behind every other owner with
jobs queued if it has more (round robin, owners in the order they first queued), and forgets an owner whose lane
is empty: a job of one owner waits for at most one job of each owner ahead of it, however many the others queued.
With `per_owner`, a lane holds at most that many: `add` to a full lane takes out its oldest job and returns it to
the caller to dispose of. Every operation is O(1) (a dict and a deque per owner); only `owners` walks the lanes.

Not thread-safe: callers lock, or touch it from one thread only (cache/tenant_writes.py, gateway/fair_threads.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

J = TypeVar("J")


class OwnerLanes(Generic[J]):
    def __init__(self, per_owner: int | None = None) -> None:
        if per_owner is not None and per_owner < 1:
            raise ValueError("per_owner must be at least 1")
        self.per_owner = per_owner
        self._lanes: OrderedDict[Hashable, deque[J]] = OrderedDict()  # owner -> its jobs, next owner first
        self._jobs = 0  # in all lanes

    def add(self, owner: Hashable, job: J) -> J | None:
        """Queue `job` last in `owner`'s lane; the lane's oldest job, taken out, when that made it exceed
        `per_owner`, else None. A new owner's first turn comes after the owners already queued."""
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = deque()
        lane.append(job)
        if self.per_owner is not None and len(lane) > self.per_owner:
            return lane.popleft()
        self._jobs += 1
        return None

    def take(self) -> J:
        """The oldest job of the owner whose turn it is (IndexError when none is queued)."""
        if not self._lanes:
            raise IndexError("no job queued")
        owner, lane = next(iter(self._lanes.items()))
        job = lane.popleft()
        self._jobs -= 1
        if lane:
            self._lanes.move_to_end(owner)  # the other owners' turns first
        else:
            del self._lanes[owner]
        return job

    def drain(self) -> list[J]:
        """Every job queued, each owner's in order, the lanes left empty."""
        jobs = [job for lane in self._lanes.values() for job in lane]
        self._lanes.clear()
        self._jobs = 0
        return jobs

    def queued(self, owner: Hashable) -> int:
        """Jobs of `owner` waiting."""
        return len(self._lanes.get(owner, ()))

    def owners(self) -> list[Hashable]:
        """The owners with jobs queued, next turn first (O(owners): for tests and metrics)."""
        return list(self._lanes)

    def __len__(self) -> int:
        """Jobs waiting in all lanes."""
        return self._jobs
