"""A circuit breaker per replica: stop sending requests to a replica that keeps failing, probe it later.

Health checks see a replica every few seconds; the breaker sees every request, so it reacts within a
handful of failures. States:

- closed: requests flow. It opens after `failures_to_open` consecutive failures, or when at least
  `min_requests` finished inside the last `window_s` and `failure_rate_to_open` of them failed (a replica
  that fails every other request never strings together consecutive failures, yet is no good either).
- open: no request is sent for `cooldown_s`.
- half_open: after the cool-down, exactly one request (the probe) is let through. Its success closes the
  breaker; its failure opens it again for another cool-down.

Only failures of the replica count (unreachable, timed out, 5xx, a broken stream), never a client's 4xx.
Every state change is reported once through `on_change` (the fleet logs it; metrics read `state`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]
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
        self._outcomes: deque[tuple[float, bool]] = deque()  # (time, failed) inside the window

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

    def success(self) -> None:
        self._record(False)
        self.consecutive_failures = 0
        if self._state == "half_open":
            self._probing = False
            self._move("closed", "the probe succeeded")

    def failure(self, why: str) -> None:
        self._record(True)
        self.consecutive_failures += 1
        if self._state == "half_open":
            self._probing = False
            self._open(f"the probe failed: {why}")
        elif self._state == "closed":
            if self.consecutive_failures >= self.config.failures_to_open:
                self._open(f"{self.consecutive_failures} consecutive failures, the last: {why}")
            elif self._rate_exceeded():
                n = len(self._outcomes)
                failed = sum(f for _, f in self._outcomes)
                self._open(f"{failed} of {n} requests failed in {self.config.window_s:g}s, the last: {why}")

    def abandon(self) -> None:
        """A request ended with no verdict (the client went away): a probe slot is given back."""
        self._probing = False

    def _record(self, failed: bool) -> None:
        now = self._clock()
        self._outcomes.append((now, failed))
        cutoff = now - self.config.window_s
        while self._outcomes and self._outcomes[0][0] < cutoff:
            self._outcomes.popleft()

    def _rate_exceeded(self) -> bool:
        n = len(self._outcomes)
        return n >= self.config.min_requests and sum(f for _, f in self._outcomes) / n >= \
            self.config.failure_rate_to_open

    def _open(self, why: str) -> None:
        self._opened_at = self._clock()
        self._outcomes.clear()  # a closed breaker starts from a clean window
        self._move("open", why)

    def _move(self, new: State, why: str) -> None:
        old, self._state = self._state, new
        if old != new and self.on_change is not None:
            self.on_change(old, new, why)
