"""One replica of a tier: where it answers and whether it can now."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def mark(self, status: str, reason: str) -> None:
        self.status = status
        self.reason = reason
        self.healthy = status == "ready"
        self.ever_ready = self.ever_ready or self.healthy

    @property
    def is_down(self) -> bool:
        """Failing, as opposed to starting for the first time or waiting for its model to be built."""
        return not self.healthy and (self.status == "down" or (self.status == "starting" and self.ever_ready))

    def public(self) -> dict[str, object]:
        return {"index": self.index, "status": self.status, "reason": self.reason or None,
                "inflight": self.inflight, "restarts": self.restarts}
