"""What the tiers log while a replica is down: an engine's crash loop and a tier no replica can serve are each
logged once per fault, then one line when they work again (quotas/fault_log.py), not a line a restart or a request."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from tests.tiers.test_supervisor import StubEngineProcess, built_model, spec, wait_until
from tiers import supervisor
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.errors import NoTierAvailable
from tiers.fleet import Fleet
from tiers.replica import Replica

MID = {"backend": "openai", "model": "m1", "urls": ["http://a:1", "http://b:1"], "price_per_1k_input": "0.001",
       "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}


class CrashingEngine(StubEngineProcess):
    """Exits at once (code 3) until `crashes` runs have; then the stub engine, which becomes ready."""

    crashes = 8

    def command(self, port: int) -> list[str]:
        if self.replica.restarts < self.crashes:
            return [sys.executable, "-c", "raise SystemExit(3)"]
        return super().command(port)


async def test_a_crash_loop_is_one_line_then_one_line_when_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(supervisor, "BACKOFF_MAX_S", 0.02)
    client = TierClient()
    replica = Replica("mid", 0)
    proc = CrashingEngine(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path, log_dir=tmp_path / "logs",
                          client=client, start_timeout_s=30, health_every_s=0.05)
    task = asyncio.create_task(proc.run())
    try:
        with caplog.at_level(logging.INFO, logger="tiergate.supervisor"):
            await wait_until(lambda: replica.healthy)
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name == "tiergate.supervisor"]
    assert replica.restarts == 8
    assert len(lines) == 2, lines
    assert "engine exited with code 3" in lines[0] and str(proc.log_path) in lines[0]
    assert lines[1] == "tier mid replica 0: its engine recovered after 8 failed starts"


def test_a_tier_with_no_replica_up_logs_once_not_per_request(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(TierCatalogue.model_validate({"tiers": {"mid": MID}}), TierClient(), models_dir=tmp_path,
                  log_dir=tmp_path, core_budget=None)
    reps = fleet.replicas["mid"]
    for rep in reps:
        rep.mark("down", "health check failed: connection refused")
    caplog.clear()  # what the fleet said as it was made
    with caplog.at_level(logging.INFO, logger="tiergate.fleet"):
        for _ in range(50):
            with pytest.raises(NoTierAvailable):
                fleet.pick("mid")
        reps[1].mark("ready", "")
        for _ in range(3):
            fleet.pick("mid")[0].breaker.success()
    lines = [r.getMessage() for r in caplog.records if r.name == "tiergate.fleet"]
    assert len(lines) == 2, lines
    assert "replica 0 down (health check failed: connection refused)" in lines[0]
    assert lines[1] == "tier 'mid': choosing a replica recovered after 50 failed requests"
