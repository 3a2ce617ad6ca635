"""The gateway metrics the ladder's triggers read, over a sliding minute."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from gateway.quantiles import kth_without
from tiers.tenant_counts import GAP, OUTCOMES, TenantCounts, left_out

WINDOW_S = 60.0
CONTEST_MIN = 10  # the other tenants' outcomes (or waits) in the window before one tenant's can be left out


def _rank(n: int) -> int:
    """The p95's rank (1-based) among n waits: the index int(0.95 * n) of the sorted waits, the last at most."""
    return min(n, int(0.95 * n) + 1)


class _WaitsStandOut:
    """Does a tenant's waits' p95 stand out of the rest's (more than GAP times it, the rest being the window without
    the tenants left out with it)? The window's waits are sorted, and those of the tenants asked about apart, on the
    first question (which names them all: `left_out` only takes tenants back after it): a read that leaves out no
    more than the busiest tenant asks none."""

    def __init__(self, waits: list[float], tenants: list[str]) -> None:
        self._waits, self._tenants = waits, tenants
        self._ordered: list[float] = []
        self._of: dict[str, list[float]] = {}  # tenant asked about -> its waits, ascending

    @property
    def asked(self) -> bool:
        return bool(self._ordered)

    def __call__(self, tenant: str, left: frozenset[str]) -> bool:
        if not self._ordered:
            self._ordered = sorted(self._waits)
        own = self._own(left)[tenant]
        return own[_rank(len(own)) - 1] > GAP * self.p95_without(left)

    def _own(self, tenants: frozenset[str]) -> dict[str, list[float]]:
        missing = tenants - self._of.keys()
        if missing:
            found: dict[str, list[float]] = {t: [] for t in missing}
            for wait, who in zip(self._waits, self._tenants, strict=True):
                if who in missing:
                    found[who].append(wait)
            for own in found.values():
                own.sort()
            self._of.update(found)
        return self._of

    def p95_without(self, left: frozenset[str]) -> float:
        """The waits' p95 but `left`'s, once a question has sorted them (else the caller filters and sorts)."""
        gone = [self._own(left)[t] for t in left]
        return kth_without(self._ordered, gone, _rank(len(self._ordered) - sum(len(g) for g in gone)))


class Signals:
    """Appended to on the event loop, read by the ladder's tick in a worker thread: a lock keeps the two apart (a
    deque appended to while a thread iterates it raises). The window's error count is kept as it goes, so a read
    costs one sort of the minute's waits (floats, in C), not a pass over every outcome; where a few tenants' waits
    may stand out together, the sort is of all of them, with a pass picking out those tenants' (`_WaitsStandOut`),
    off the lock.

    One tenant does not move the ladder for everyone. The error rate leaves out the tenant with the most 5xx, and the
    wait's p95 the tenant with the most waits, when the others have CONTEST_MIN of theirs in the window: a tenant can
    send what makes a tier fail (an input an engine or provider chokes on), or flood a tier so that its own requests
    queue (dispatch is fair between tenants, so the others' do not), and its own failures or waits would otherwise
    take every tenant down the ladder (level 3 sheds batch and standard traffic). A few tenants acting together are
    left out with it where each has CONTEST_MIN of its own and stands out of the rest (a 5xx rate, or a wait p95, more
    than twice the rest's), at most half the tenants in the window. A tier failing or overloaded for everyone fails or
    delays the others too; the only tenant, or signals of no tenant (""), count as they are. The per-tenant counts and
    who is left out are tiers/tenant_counts.py's (its docstring says what a coalition can still do), which the
    breakers share."""

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

    def _expire(self) -> None:
        """Drop what left the window (under the lock)."""
        since = self._clock() - WINDOW_S
        while self._wait_times and self._wait_times[0] < since:
            self._wait_times.popleft()
            self._wait_values.popleft()
            self._waits_of.remove(self._wait_tenants.popleft())
        while self._outcomes and self._outcomes[0][0] < since:
            _, bad, tenant = self._outcomes.popleft()
            self._counts.remove(tenant, bad)

    def outcomes(self) -> TenantCounts:
        """Each tenant's answers and 5xx in the window, a copy (what a worker shares with the others:
        gateway/ladder/shared_signals.py)."""
        with self._lock:
            self._expire()
            return self._counts.copy()

    def read(self) -> dict[str, float]:
        with self._lock:
            self._expire()
            waits = list(self._wait_values)
            contested = len(self._waits_of) > 1  # else no one is left out: the only tenant's waits are the window's
            waits_of = self._waits_of.copy() if contested else None  # copied here, judged unlocked
            tenants = list(self._wait_tenants) if contested else []
            error_rate = self._counts.rate_without(left_out(self._counts, CONTEST_MIN))
        stand_out = _WaitsStandOut(waits, tenants)
        queued = left_out(waits_of, CONTEST_MIN, by=OUTCOMES, stands_out=stand_out) \
            if waits_of is not None else frozenset()
        if stand_out.asked:
            p95 = stand_out.p95_without(queued)
        else:
            if queued:
                waits = [w for w, t in zip(waits, tenants, strict=True) if t not in queued]
            waits.sort()
            p95 = waits[_rank(len(waits)) - 1] if waits else 0.0
        return {"queue_wait_p95_s": p95, "error_rate": error_rate,
                "tiers_down": float(self._tiers_down()), "redis_down": 1.0 if self._redis_down() else 0.0,
                "kv_utilisation": float(self._kv_utilisation())}
