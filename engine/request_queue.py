"""Waiting queues: first come first served, or by priority then arrival (vLLM v1's policies)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from enum import Enum

from engine.sequence import Sequence


class SchedulingPolicy(Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # lower `priority` first, then earlier arrival


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add_request(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def prepend_request(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the front: it arrived before everyone waiting."""
        self._queue.appendleft(seq)

    def peek_request(self) -> Sequence:
        return self._queue[0]

    def pop_request(self) -> Sequence:
        return self._queue.popleft()

    def remove_request(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


class PriorityRequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._counter = itertools.count()  # breaks ties without comparing sequences

    def add_request(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.arrival_time, next(self._counter), seq))

    def prepend_request(self, seq: Sequence) -> None:
        self.add_request(seq)  # its (priority, arrival) already puts it where it belongs

    def peek_request(self) -> Sequence:
        return self._heap[0][3]

    def pop_request(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove_request(self, seq: Sequence) -> None:
        self._heap = [item for item in self._heap if item[3] is not seq]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (item[3] for item in sorted(self._heap, key=lambda item: item[:3]))


def create_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
