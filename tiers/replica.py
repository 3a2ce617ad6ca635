"""One replica of a tier: where it answers and whether it can now."""

from __future__ import annotations

from dataclasses import dataclass


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

    def mark(self, status: str, reason: str) -> None:
        self.status = status
        self.reason = reason
        self.healthy = status == "ready"

    def public(self) -> dict[str, object]:
        return {"index": self.index, "status": self.status, "reason": self.reason or None,
                "inflight": self.inflight, "restarts": self.restarts}
