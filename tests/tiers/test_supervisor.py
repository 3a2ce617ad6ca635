"""Engine supervision: a crashed engine process is restarted with backoff and comes back healthy."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.replica import Replica
from tiers.supervisor import EngineProcess

STUB_ENGINE = Path(__file__).resolve().parent / "stub_engine.py"


class StubEngineProcess(EngineProcess):
    """Runs a stub engine (a tiny HTTP server with /health) instead of a model."""

    def command(self, port: int) -> list[str]:
        return [sys.executable, str(STUB_ENGINE), str(port)]


def spec(model: str) -> TierSpec:
    return TierSpec(name="mid", backend="local", model=model, price_per_1k_input="0", price_per_1k_output="0",
                    hardware_cost_per_hour="0", context_limit=1024)


async def wait_until(cond, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_crashed_engine_is_restarted(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    client = TierClient()
    replica = Replica("mid", 0)
    proc = StubEngineProcess(spec(str(model_dir)), replica, models_dir=tmp_path, log_dir=tmp_path / "logs",
                             client=client, start_timeout_s=30)
    task = asyncio.create_task(proc.run())
    try:
        await wait_until(lambda: replica.healthy)
        first_url, first_pid = replica.url, proc.proc.pid  # type: ignore[union-attr]
        os.kill(first_pid, signal.SIGKILL)
        await wait_until(lambda: not replica.healthy)
        assert replica.status == "down" and "restarting" in replica.reason and replica.restarts == 1
        await wait_until(lambda: replica.healthy)
        assert proc.proc.pid != first_pid and replica.url != first_url  # type: ignore[union-attr]
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()


async def test_tier_without_its_model_waits_as_unavailable(tmp_path: Path) -> None:
    client = TierClient()
    replica = Replica("small", 0)
    proc = StubEngineProcess(spec("students/not-built"), replica, models_dir=tmp_path, log_dir=tmp_path,
                             client=client, start_timeout_s=30)
    task = asyncio.create_task(proc.run())
    try:
        await wait_until(lambda: replica.status == "unavailable")
        assert "not built yet" in replica.reason and proc.proc is None
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()


def test_a_first_start_is_not_an_outage_but_a_restart_is() -> None:
    r = Replica("mid", 0)
    r.mark("starting", "loading")
    assert not r.is_down
    r.mark("ready", "")
    r.mark("down", "exited")
    assert r.is_down
    r.mark("starting", "loading again")
    assert r.is_down
    r.mark("unavailable", "not built")
    assert not r.is_down


async def test_an_unbuilt_model_is_preparing_while_its_build_runs(tmp_path: Path) -> None:
    import json

    from tiers.students import build_lock, work_dir_for

    out = tmp_path / "students" / "small"
    client = TierClient()
    replica = Replica("small", 0)
    proc = StubEngineProcess(spec("students/small"), replica, models_dir=tmp_path, log_dir=tmp_path / "logs",
                             client=client, start_timeout_s=30)
    proc.spec.prepared_by = "tiergate models distill --teacher full"
    proc._mark_unbuilt()
    assert replica.status == "unavailable" and "tiergate models distill --teacher full" in replica.reason
    with build_lock(out):
        work_dir_for(out).mkdir(parents=True)
        (work_dir_for(out) / "progress.json").write_text(json.dumps({"step": 5, "train_s": 150.0, "budget_s": 600.0,
                                                                     "agree": 0.21}))
        proc._mark_unbuilt()
        assert replica.status == "preparing" and not replica.healthy and not replica.is_down
        assert "25% of its 600s budget" in replica.reason and "21%" in replica.reason
    proc._mark_unbuilt()  # the build ended without a model (killed): back to unavailable
    assert replica.status == "unavailable"
    await client.aclose()


def test_the_engine_command_carries_the_kv_cache_dtype(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    replica = Replica("mid", 0)
    plain = EngineProcess(spec(str(model_dir)), replica, models_dir=tmp_path, log_dir=tmp_path,
                          client=TierClient(), start_timeout_s=1)
    assert "--kv-cache-dtype" not in plain.command(9000)  # auto: the engine's default
    narrow = EngineProcess(spec(str(model_dir)).model_copy(update={"kv_cache_dtype": "bf16"}), replica,
                           models_dir=tmp_path, log_dir=tmp_path, client=TierClient(), start_timeout_s=1)
    cmd = narrow.command(9000)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "bf16"
