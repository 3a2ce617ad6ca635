"""The gateway metrics the ladder's triggers read, over a sliding minute."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 60.0
CONTEST_MIN = 10  # the other tenants' outcomes (or waits) in the window before one tenant's can be left out


class Signals:
    """Appended to on the event loop, read by the ladder's tick in a worker thread: a lock keeps the two apart (a
    deque appended to while a thread iterates it raises). The window's error count is kept as it goes, so a read
    costs one sort of the minute's waits (floats, in C), not a pass over every outcome.

    One tenant does not move the ladder for everyone. The error rate leaves out the tenant with the most 5xx, and the
    wait's p95 the tenant with the most waits, when the others have CONTEST_MIN of theirs in the window: a tenant can
    send what makes a tier fail (an input an engine or provider chokes on), or flood a tier so that its own requests
    queue (dispatch is fair between tenants, so the others' do not), and its own failures or waits would otherwise
    take every tenant down the ladder (level 3 sheds batch and standard traffic). A tier failing or overloaded for
    everyone fails or delays the others too; the only tenant, or signals of no tenant (""), count as they are. As
    in the rollout guards and the breakers, two tenants acting together are not covered."""

    def __init__(self, *, tiers_down: Callable[[], int] = lambda: 0, redis_down: Callable[[], bool] = lambda: False,
                 kv_utilisation: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kv_utilisation = kv_utilisation
        self._wait_times: deque[float] = deque()
        self._wait_values: deque[float] = deque()  # the wait of each time above
        self._wait_tenants: deque[str] = deque()  # whose request waited
        self._waits_of: dict[str, int] = {}  # tenant -> its waits in the window
        self._outcomes: deque[tuple[float, bool, str]] = deque()  # (time, was a 5xx, tenant)
        self._errors = 0  # the 5xx among `_outcomes`
        self._by_tenant: dict[str, list[int]] = {}  # tenant -> [outcomes, 5xx] in the window
        self._lock = threading.Lock()
        self._tiers_down = tiers_down
        self._redis_down = redis_down
        self._clock = clock

    def queue_wait(self, seconds: float, tenant: str = "") -> None:
        with self._lock:
            self._wait_times.append(self._clock())
            self._wait_values.append(seconds)
            self._wait_tenants.append(tenant)
            self._waits_of[tenant] = self._waits_of.get(tenant, 0) + 1

    def outcome(self, status: int, tenant: str = "") -> None:
        bad = status >= 500
        with self._lock:
            self._outcomes.append((self._clock(), bad, tenant))
            self._count(tenant, bad, 1)

    def _count(self, tenant: str, bad: bool, step: int) -> None:
        counts = self._by_tenant.setdefault(tenant, [0, 0])
        counts[0] += step
        counts[1] += step * bad
        self._errors += step * bad
        if not counts[0]:
            del self._by_tenant[tenant]

    def _error_rate(self) -> float:
        n, errors = len(self._outcomes), self._errors
        if not n:
            return 0.0
        worst, (own_n, own_errors) = max(self._by_tenant.items(), key=lambda kv: kv[1][1])
        if worst and n - own_n >= CONTEST_MIN:
            n, errors = n - own_n, errors - own_errors
        return errors / n

    def read(self) -> dict[str, float]:
        with self._lock:
            since = self._clock() - WINDOW_S
            while self._wait_times and self._wait_times[0] < since:
                self._wait_times.popleft()
                self._wait_values.popleft()
                gone = self._wait_tenants.popleft()
                self._waits_of[gone] -= 1
                if not self._waits_of[gone]:
                    del self._waits_of[gone]
            while self._outcomes and self._outcomes[0][0] < since:
                _, bad, tenant = self._outcomes.popleft()
                self._count(tenant, bad, -1)
            waits = list(self._wait_values)
            busiest = max(self._waits_of.items(), key=lambda kv: kv[1], default=("", 0))
            left_out = busiest[0] if busiest[0] and len(waits) - busiest[1] >= CONTEST_MIN else None
            tenants = list(self._wait_tenants) if left_out is not None else []  # copied here, filtered unlocked
            error_rate = self._error_rate()
        if left_out is not None:
            waits = [w for w, t in zip(waits, tenants, strict=True) if t != left_out]
        waits.sort()
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        return {"queue_wait_p95_s": p95, "error_rate": error_rate,
                "tiers_down": float(self._tiers_down()), "redis_down": 1.0 if self._redis_down() else 0.0,
                "kv_utilisation": float(self._kv_utilisation())}
