"""One replica of a tier: where it answers, whether it can now, and how fast it has been answering."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiers.breaker import CircuitBreaker

EWMA_ALPHA = 0.2  # weight of the newest sample: about the last ten requests matter


@dataclass
class Replica:
    tier: str
    index: int
    url: str | None = None
    status: str = "starting"  # starting | ready | down | unavailable
    reason: str = "starting"
    healthy: bool = False
    inflight: int = 0
    restarts: int = 0
    ever_ready: bool = False  # a first start (loading the model) is not an outage; a later one is
    stats: dict[str, float] = field(default_factory=dict)  # what the engine's /health last reported
    model_version: str | None = None  # the engine's fingerprint of weights, quantization, engine version
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    latency_ewma_s: float | None = None  # upstream time per request, smoothed; None until one finishes
    last_heard: float | None = None  # time.monotonic() of the last chunk one of our requests got from it
    busy_since: float | None = None  # time.monotonic() its requests in flight began (0 to 1); kept after
    unanswered: int = 0  # its health checks unanswered in a row (a remote replica's; tiers/fleet.py)

    def mark(self, status: str, reason: str) -> None:
        self.status = status
        self.reason = reason
        self.healthy = status == "ready"
        self.ever_ready = self.ever_ready or self.healthy

    @property
    def is_down(self) -> bool:
        """Failing, as opposed to starting for the first time or waiting for its model to be built."""
        return not self.healthy and (self.status == "down" or (self.status == "starting" and self.ever_ready))

    @property
    def can_take(self) -> bool:
        """Healthy by its checks, and its breaker lets a request through."""
        return self.healthy and self.breaker.can_take()

    def observe_latency(self, seconds: float) -> None:
        self.latency_ewma_s = seconds if self.latency_ewma_s is None else \
            (1 - EWMA_ALPHA) * self.latency_ewma_s + EWMA_ALPHA * seconds

    def predicted_wait_s(self, default_latency_s: float) -> float:
        """Requests ahead of a new one times how long one takes here (the tier's typical time until measured)."""
        latency = self.latency_ewma_s if self.latency_ewma_s is not None else default_latency_s
        return self.inflight * latency

    def public(self) -> dict[str, object]:
        return {"index": self.index, "status": self.status, "reason": self.reason or None,
                "inflight": self.inflight, "restarts": self.restarts, "breaker": self.breaker.state,
                "latency_ewma_s": None if self.latency_ewma_s is None else round(self.latency_ewma_s, 4)}
