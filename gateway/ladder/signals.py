"""The gateway metrics the ladder's triggers read, over a sliding minute."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0


class Signals:
    def __init__(self, *, tiers_down: Callable[[], int] = lambda: 0, redis_down: Callable[[], bool] = lambda: False,
                 kv_utilisation: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kv_utilisation = kv_utilisation
        self._waits: deque[tuple[float, float]] = deque()
        self._outcomes: deque[tuple[float, bool]] = deque()  # (time, was a 5xx)
        self._tiers_down = tiers_down
        self._redis_down = redis_down
        self._clock = clock

    def queue_wait(self, seconds: float) -> None:
        self._waits.append((self._clock(), seconds))

    def outcome(self, status: int) -> None:
        self._outcomes.append((self._clock(), status >= 500))

    def read(self) -> dict[str, float]:
        now = self._clock()
        for q in (self._waits, self._outcomes):
            while q and q[0][0] < now - WINDOW_S:
                q.popleft()
        waits = sorted(w for _, w in self._waits)
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        errors = sum(bad for _, bad in self._outcomes)
        return {"queue_wait_p95_s": p95, "error_rate": errors / len(self._outcomes) if self._outcomes else 0.0,
                "tiers_down": float(self._tiers_down()), "redis_down": 1.0 if self._redis_down() else 0.0,
                "kv_utilisation": float(self._kv_utilisation())}
