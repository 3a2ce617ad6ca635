"""A circuit breaker per replica: stop sending requests to a replica that keeps failing, probe it later.

Health checks see a replica every few seconds; the breaker sees every request, so it reacts within a
handful of failures. States:

- closed: requests flow. It opens after `failures_to_open` consecutive failures, or when at least
  `min_requests` finished inside the last `window_s` and `failure_rate_to_open` of them failed (a replica
  that fails every other request never strings together consecutive failures, yet is no good either).
- open: no request is sent for `cooldown_s`.
- half_open: after the cool-down, exactly one request (the probe) is let through. Its success closes the
  breaker; its failure opens it again for another cool-down.

Only failures of the replica count (unreachable, timed out, 5xx, a broken stream, and a 4xx about the tier itself:
its key refused, 401 or 403, its path or model name unknown, 404, its account over a rate limit, 429), never an
answer about the tenant's own request (400, 413, 422; our engine's full compile queue): the rule is
`UpstreamRejected.replica_failed` (tiers/errors.py), the same that makes the tenant's answer the gateway's 502.
Every state change is reported once through `on_change` (the fleet logs it; metrics read `state`).

One tenant's failures do not open it while the replica works for the others. A tenant can send what makes a
replica fail (an input the engine or a provider chokes on, prompts that time out): left alone, five of those at
once would take the replica from every tenant for the cool-down, again and again. So each outcome keeps its tenant,
and failures that are one tenant's (every failure of the consecutive run, or the most of the window's for the
rate) are *held* by it when the other tenants' outcomes in the window (at least CONTEST_MIN) fail less than the
rate that opens. So are a few tenants' together (two attackers taking turns): a run of failures of a few tenants,
or the window's worst few, each failing more than twice as often as the rest, at most half the tenants in the
window (tiers/tenant_counts.py says why, and what it leaves uncovered). A replica that breaks for everyone fails the
others' next requests too, and opens as before; a tier with one tenant, or the gateway's own calls (no tenant), are
judged on what they have. A probe's failure reopens whoever sent it: the probe is one request, and half-open is
already the replica's penalty box. The counts and the rule of who is left out are tiers/tenant_counts.py's, which
the ladder's signals share.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tiers.tenant_counts import CONTEST_MAX, TenantCounts, left_out, may_leave_out

State = Literal["closed", "open", "half_open"]
CONTEST_MIN = 5  # outcomes of the other tenants in the window before one tenant's failures can be held
STATE_VALUE: dict[str, int] = {"closed": 0, "half_open": 1, "open": 2}  # the metric's encoding


@dataclass(frozen=True)
class BreakerConfig:
    failures_to_open: int = 5  # consecutive failures
    failure_rate_to_open: float = 0.5  # ...or this share of the window's outcomes
    min_requests: int = 10  # outcomes in the window before the rate counts
    window_s: float = 30.0
    cooldown_s: float = 10.0  # open this long before one probe is let through


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[State, State, str], None] | None = None) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self.on_change = on_change  # (old, new, why)
        self._state: State = "closed"
        self._opened_at = 0.0
        self._probing = False  # half-open: the one probe is in flight
        self.consecutive_failures = 0
        self._run_tenants: set[str] = set()  # whose failures the consecutive run holds (past CONTEST_MAX, no matter)
        self._outcomes: deque[tuple[float, bool, str]] = deque()  # (time, failed, tenant) inside the window
        self._counts = TenantCounts()  # each tenant's outcomes and failures in the window

    @property
    def state(self) -> State:
        """The state now (an open breaker whose cool-down has passed reads as half-open)."""
        if self._state == "open" and self._clock() - self._opened_at >= self.config.cooldown_s:
            self._move("half_open", f"cool-down of {self.config.cooldown_s:g}s passed; one probe allowed")
        return self._state

    def can_take(self) -> bool:
        """May a request be sent now? (Does not claim anything; `begin` does.)"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._probing)

    def begin(self) -> None:
        """A request was sent: in half-open it is the probe, and no other goes until it ends."""
        if self.state == "half_open":
            self._probing = True

    def success(self, tenant: str = "") -> None:
        """The replica answered; `tenant`: whose request it was ("" for the gateway's own)."""
        self._record(False, tenant)
        self.consecutive_failures = 0
        self._run_tenants.clear()
        if self._state == "half_open":
            self._probing = False
            self._move("closed", "the probe succeeded")

    def failure(self, why: str, tenant: str = "") -> None:
        """The replica failed `tenant`'s request ("" for the gateway's own, never held)."""
        self._record(True, tenant)
        self.consecutive_failures += 1
        if len(self._run_tenants) <= CONTEST_MAX:
            self._run_tenants.add(tenant)
        if self._state == "half_open":
            self._probing = False
            self._open(f"the probe failed: {why}")
        elif self._state == "closed":
            if self.consecutive_failures >= self.config.failures_to_open and not self._run_held():
                self._open(f"{self.consecutive_failures} consecutive failures, the last: {why}")
            elif self._rate_exceeded() and not self._held(left_out(self._counts, CONTEST_MIN)):
                n, failed = self._counts.n, self._counts.bad
                self._open(f"{failed} of {n} requests failed in {self.config.window_s:g}s, the last: {why}")

    def abandon(self) -> None:
        """A request ended with no verdict (the client went away): a probe slot is given back."""
        self._probing = False

    def _record(self, failed: bool, tenant: str) -> None:
        now = self._clock()
        self._outcomes.append((now, failed, tenant))
        self._counts.add(tenant, failed)
        cutoff = now - self.config.window_s
        while self._outcomes and self._outcomes[0][0] < cutoff:
            _, old_failed, old_tenant = self._outcomes.popleft()
            self._counts.remove(old_tenant, old_failed)

    def _rate_exceeded(self) -> bool:
        n = self._counts.n
        return n >= self.config.min_requests and self._counts.bad / n >= self.config.failure_rate_to_open

    def _run_held(self) -> bool:
        """Are the consecutive failures their tenants' own: the run's tenants alone (one, or a few standing out of the
        rest), or with the others the window's rate leaves out (the run is one attacker's, the other's came before)?"""
        run = self._run_tenants
        if may_leave_out(self._counts, run, CONTEST_MIN) and self._held(run):
            return True
        with_others = run | left_out(self._counts, CONTEST_MIN)
        return with_others != run and may_leave_out(self._counts, with_others, CONTEST_MIN) and self._held(with_others)

    def _held(self, tenants: frozenset[str] | set[str]) -> bool:
        """Do the other tenants' outcomes in the window say the replica works, so `tenants`' failures are their own?"""
        if not tenants or "" in tenants:
            return False
        others, others_failed = self._counts.without(tenants)
        return others >= CONTEST_MIN and others_failed / others < self.config.failure_rate_to_open

    def _open(self, why: str) -> None:
        self._opened_at = self._clock()
        self._outcomes.clear()  # a closed breaker starts from a clean window
        self._counts.clear()
        self._run_tenants.clear()
        self._move("open", why)

    def _move(self, new: State, why: str) -> None:
        old, self._state = self._state, new
        if old != new and self.on_change is not None:
            self.on_change(old, new, why)
