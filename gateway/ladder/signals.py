"""The gateway metrics the ladder's triggers read, over a sliding minute."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from tiers.tenant_counts import OUTCOMES, TenantCounts, left_out

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
    in the rollout guards and the breakers, two tenants acting together are not covered. The per-tenant counts and
    who is left out are tiers/tenant_counts.py's, which the breakers share."""

    def __init__(self, *, tiers_down: Callable[[], int] = lambda: 0, redis_down: Callable[[], bool] = lambda: False,
                 kv_utilisation: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kv_utilisation = kv_utilisation
        self._wait_times: deque[float] = deque()
        self._wait_values: deque[float] = deque()  # the wait of each time above
        self._wait_tenants: deque[str] = deque()  # whose request waited
        self._waits_of = TenantCounts()  # each tenant's waits in the window
        self._outcomes: deque[tuple[float, bool, str]] = deque()  # (time, was a 5xx, tenant)
        self._counts = TenantCounts()  # each tenant's outcomes and 5xx in the window
        self._lock = threading.Lock()
        self._tiers_down = tiers_down
        self._redis_down = redis_down
        self._clock = clock

    def queue_wait(self, seconds: float, tenant: str = "") -> None:
        with self._lock:
            self._wait_times.append(self._clock())
            self._wait_values.append(seconds)
            self._wait_tenants.append(tenant)
            self._waits_of.add(tenant)

    def outcome(self, status: int, tenant: str = "") -> None:
        bad = status >= 500
        with self._lock:
            self._outcomes.append((self._clock(), bad, tenant))
            self._counts.add(tenant, bad)

    def read(self) -> dict[str, float]:
        with self._lock:
            since = self._clock() - WINDOW_S
            while self._wait_times and self._wait_times[0] < since:
                self._wait_times.popleft()
                self._wait_values.popleft()
                self._waits_of.remove(self._wait_tenants.popleft())
            while self._outcomes and self._outcomes[0][0] < since:
                _, bad, tenant = self._outcomes.popleft()
                self._counts.remove(tenant, bad)
            waits = list(self._wait_values)
            queued = left_out(self._waits_of, CONTEST_MIN, by=OUTCOMES)  # the busiest, where the others have enough
            tenants = list(self._wait_tenants) if queued else []  # copied here, filtered unlocked
            error_rate = self._counts.rate_without(left_out(self._counts, CONTEST_MIN))
        if queued:
            waits = [w for w, t in zip(waits, tenants, strict=True) if t not in queued]
        waits.sort()
        p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
        return {"queue_wait_p95_s": p95, "error_rate": error_rate,
                "tiers_down": float(self._tiers_down()), "redis_down": 1.0 if self._redis_down() else 0.0,
                "kv_utilisation": float(self._kv_utilisation())}
