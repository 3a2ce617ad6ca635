"""The gateway metrics the ladder's triggers read, over a sliding minute."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0


class Signals:
    """Appended to on the event loop, read by the ladder's tick in a worker thread: a lock keeps the two apart (a
    deque appended to while a thread iterates it raises). The window's error count is kept as it goes, so a read
    costs one sort of the minute's waits (floats, in C), not a pass over every outcome."""

    def __init__(self, *, tiers_down: Callable[[], int] = lambda: 0, redis_down: Callable[[], bool] = lambda: False,
                 kv_utilisation: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kv_utilisation = kv_utilisation
        self._wait_times: deque[float] = deque()
        self._wait_values: deque[float] = deque()  # the wait of each time above
        self._outcomes: deque[tuple[float, bool]] = deque()  # (time, was a 5xx)
        self._errors = 0  # the 5xx among `_outcomes`
        self._lock = threading.Lock()
        self._tiers_down = tiers_down
        self._redis_down = redis_down
        self._clock = clock

    def queue_wait(self, seconds: float) -> None:
        with self._lock:
            self._wait_times.append(self._clock())
            self._wait_values.append(seconds)

    def outcome(self, status: int) -> None:
        bad = status >= 500
        with self._lock:
            self._outcomes.append((self._clock(), bad))
            self._errors += bad

    def read(self) -> dict[str, float]:
        with self._lock:
            since = self._clock() - WINDOW_S
            while self._wait_times and self._wait_times[0] < since:
                self._wait_times.popleft()
                self._wait_values.popleft()
            while self._outcomes and self._outcomes[0][0] < since:
                self._errors -= self._outcomes.popleft()[1]
            waits = list(self._wait_values)
            errors, outcomes = self._errors, len(self._outcomes)
        waits.sort()
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        return {"queue_wait_p95_s": p95, "error_rate": errors / outcomes if outcomes else 0.0,
                "tiers_down": float(self._tiers_down()), "redis_down": 1.0 if self._redis_down() else 0.0,
                "kv_utilisation": float(self._kv_utilisation())}
