"""An engine's stats are read once a replica by a scrape: the health poller replaces them whole
(tiers/supervisor.py) while /metrics renders on its own thread, and a scrape that read them twice (is the stat
there? then its value) raised KeyError where a poll in between dropped the stat."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from gateway.metrics import GatewayMetrics
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet
from tiers.replica import Replica


class Polled(Replica):
    """A replica whose stats a poll replaces after each read (a new dict, without the stat read before)."""

    reads = 0

    @property  # type: ignore[override]
    def stats(self) -> dict[str, float]:
        self.reads += 1
        return {"num_running": 3.0} if self.reads % 2 else {}

    @stats.setter
    def stats(self, value: dict[str, float]) -> None:
        pass


def test_a_scrape_reads_each_replicas_stats_once(tmp_path: Path) -> None:
    catalogue = TierCatalogue.model_validate({"tiers": {"mid": {
        "backend": "openai", "model": "m", "urls": ["http://127.0.0.1:1"], "price_per_1k_input": "0",
        "price_per_1k_output": "0", "hardware_cost_per_hour": "0", "context_limit": 1024}}})
    fleet = Fleet(catalogue, TierClient(), models_dir=tmp_path, log_dir=tmp_path)
    fleet.replicas["mid"][0].__class__ = Polled
    text = generate_latest(GatewayMetrics(fleet).registry).decode()
    assert 'tiergate_engine_running{replica="0",tier="mid"}' in text
