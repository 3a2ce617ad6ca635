"""What the tiers log while a replica is down: an engine's crash loop and a tier no replica can serve are each
logged once per fault, then one line when they work again (quotas/fault_log.py), not a line a restart or a request."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from tests.tiers.test_supervisor import StubEngineProcess, built_model, spec, wait_until
from tiers import engines_file, supervisor
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.engines_file import publish_engines, write_document
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


async def _run_until_ready(engine: type[StubEngineProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           caplog: pytest.LogCaptureFixture, **timeouts: float
                           ) -> tuple[Replica, StubEngineProcess, list[str]]:
    """Supervise `engine` (its restarts 10-20 ms apart) until its replica is healthy; the supervisor's log lines."""
    monkeypatch.setattr(supervisor, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(supervisor, "BACKOFF_MAX_S", 0.02)
    client = TierClient()
    replica = Replica("mid", 0)
    proc = engine(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path, log_dir=tmp_path / "logs",
                  client=client, health_every_s=0.05, **timeouts)
    task = asyncio.create_task(proc.run())
    try:
        with caplog.at_level(logging.INFO, logger="tiergate.supervisor"):
            await wait_until(lambda: replica.healthy)
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()
    return replica, proc, [r.getMessage() for r in caplog.records if r.name == "tiergate.supervisor"]


async def test_a_crash_loop_is_one_line_then_one_line_when_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    replica, proc, lines = await _run_until_ready(CrashingEngine, tmp_path, monkeypatch, caplog, start_timeout_s=30)
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


async def test_publishing_the_engines_outlives_a_full_disk_and_says_so_once(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The parent's writes of the engines file fail 30 rounds (a full disk), then work: the task went on (it ended at
    the first, and the workers then never heard of an engine's restart), one line, then one, and the file is there."""
    path = tmp_path / "engines.json"
    failures = 30

    def write(to: Path, document: object) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise OSError(28, "No space left on device")
        write_document(to, document)

    monkeypatch.setattr(engines_file, "write_document", write)
    with caplog.at_level(logging.INFO, logger="tiergate.supervisor"):
        task = asyncio.create_task(publish_engines(path, lambda: {"core_budget": None, "replicas": []}, every_s=0))
        try:
            await wait_until(lambda: path.exists() or task.done())
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    got = [r.getMessage() for r in caplog.records if r.name == "tiergate.supervisor"]
    assert len(got) == 2, got
    assert "No space left on device" in got[0] and got[1].endswith("recovered after 30 failed rounds")


class SilentEngine(StubEngineProcess):
    """Never answers its port (killed at the start-up deadline) until `kills` runs have; then the stub engine."""

    kills = 5

    def command(self, port: int) -> list[str]:
        if self.replica.restarts < self.kills:
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        return super().command(port)


async def test_an_engine_killed_at_each_start_is_one_line_though_each_start_has_its_own_port(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each start's probe failures name its port: the same fault, logged once (was a kill line and a restart line
    each start)."""
    replica, _, lines = await _run_until_ready(SilentEngine, tmp_path, monkeypatch, caplog, start_timeout_s=0.3,
                                               probe_timeout_s=0.2)
    assert replica.restarts == 5
    assert len(lines) == 2, lines
    assert "engine not ready after" in lines[0] and "<port>" in lines[0]
    assert lines[1] == "tier mid replica 0: its engine recovered after 5 failed starts"
