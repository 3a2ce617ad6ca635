"""A few slots shared by every tenant's threads, handed out fairly: a slot that frees goes to the waiting owner
holding the fewest, not to whichever thread the scheduler wakes first.

The meaning check (cache/meaning_check.py) runs at most a few passes at once, each tens of milliseconds of a core.
With a plain semaphore, a tenant whose flood of near-miss lookups kept several threads waiting for a pass had
most of the slots as they freed, and another tenant's one candidate waited behind them, up to the check's wait
limit, and was then refused (a miss it pays the tier for). Here a freed slot goes to the waiting owner with the
fewest slots held, the longest waiting of those first, and an owner that takes one goes behind the others still
waiting: another owner's thread waits for at most the passes already running. Work-conserving: one owner alone
may hold every slot.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable


class FairSlots:
    """`n` slots taken by owners (tenants) from any thread; `acquire` blocks, up to a timeout."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("n must be at least 1")
        self.n = n
        self._free = n
        self._held: Counter[Hashable] = Counter()
        self._waiting: OrderedDict[Hashable, int] = OrderedDict()  # owner -> its threads waiting, next turn first
        self._cond = threading.Condition(threading.Lock())

    def held(self, owner: Hashable) -> int:
        with self._cond:
            return self._held.get(owner, 0)

    def acquire(self, owner: Hashable, timeout: float) -> bool:
        """A slot for `owner`, in its turn; False when none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiting[owner] = self._waiting.get(owner, 0) + 1
            try:
                while not (self._free and self._next() == owner):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                self._free -= 1
                self._held[owner] += 1
                if self._waiting[owner] > 1:
                    self._waiting.move_to_end(owner)  # its other threads wait for the others' turns
                return True
            finally:
                self._waiting[owner] -= 1
                if not self._waiting[owner]:
                    del self._waiting[owner]
                self._cond.notify_all()  # the next owner in line may be another now

    def release(self, owner: Hashable) -> None:
        with self._cond:
            if self._held.get(owner, 0) < 1:
                raise RuntimeError(f"{owner!r} holds no slot")
            self._held[owner] -= 1
            if not self._held[owner]:
                del self._held[owner]
            self._free += 1
            self._cond.notify_all()

    def _next(self) -> Hashable:
        """The waiting owner whose turn it is: the fewest held, then the first in line. Owners waiting are at
        most the threads that wait, a few."""
        return min(self._waiting, key=lambda owner: self._held.get(owner, 0))
