"""Waiting queues: first come first served, or by priority then arrival (vLLM v1's policies).

Both keep their sequences in one list sorted by the policy's key, the head at the list's end: peeking and popping the
head cost O(1), adding or removing one (an abort, or a later sequence admitted before the head) a bisection and a move
of the list's pointers, and iterating in order sorts nothing, so a step that reads only the first few waiting reads
only those. (A heap re-sorted whole on every iteration, and rebuilt on every removal, cost 35-81 ms a step at 5,000
waiting and 1.7 s for 2,000 aborts of them; the engine also caps how many wait: LLMEngine's `max_waiting`.)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from enum import Enum

from engine.sequence import Sequence


class SchedulingPolicy(Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # lower `priority` first, then earlier arrival


Key = tuple[float, ...]


class _SortedQueue:
    """Sequences in ascending order of `_key` (unique per entry), kept in a list in descending order (the items' keys
    negated), so the head is the list's last item."""

    def __init__(self) -> None:
        self._items: list[tuple[Key, Sequence]] = []  # (the key negated, the sequence), ascending: the head last
        self._keys: dict[int, Key] = {}  # id(seq) -> its item's negated key, for removal

    def _key(self, seq: Sequence, *, front: bool) -> Key:
        raise NotImplementedError

    def _insert(self, seq: Sequence, *, front: bool) -> None:
        key = tuple(-k for k in self._key(seq, front=front))
        self._keys[id(seq)] = key
        bisect.insort(self._items, (key, seq), key=lambda item: item[0])  # keys are unique: sequences never compared

    def add_request(self, seq: Sequence) -> None:
        self._insert(seq, front=False)

    def peek_request(self) -> Sequence:
        return self._items[-1][1]

    def pop_request(self) -> Sequence:
        seq = self._items.pop()[1]
        del self._keys[id(seq)]
        return seq

    def remove_request(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is (nothing if it is not here)."""
        key = self._keys.pop(id(seq), None)
        if key is None:
            return
        i = bisect.bisect_left(self._items, key, key=lambda item: item[0])
        assert self._items[i][1] is seq
        del self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        """In queue order, the head first; lazily (a caller that stops after a few reads only those)."""
        return (item[1] for item in reversed(self._items))


class FCFSRequestQueue(_SortedQueue):
    """In the order they came; a preempted sequence goes back to the front (it arrived before everyone waiting)."""

    def __init__(self) -> None:
        super().__init__()
        self._back = itertools.count(1)  # each added one after all before it
        self._front = itertools.count(0, -1)  # each prepended one before all before it

    def _key(self, seq: Sequence, *, front: bool) -> Key:
        return (next(self._front if front else self._back),)

    def prepend_request(self, seq: Sequence) -> None:
        self._insert(seq, front=True)


class PriorityRequestQueue(_SortedQueue):
    """Lower `priority` first, then earlier arrival, then the order they were added in."""

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()  # breaks ties without comparing sequences

    def _key(self, seq: Sequence, *, front: bool) -> Key:
        return (seq.priority, seq.arrival_time, next(self._counter))

    def prepend_request(self, seq: Sequence) -> None:
        self.add_request(seq)  # its (priority, arrival) already puts it where it belongs


def create_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
