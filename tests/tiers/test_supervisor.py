"""Engine supervision: a crashed engine process is restarted with backoff and comes back healthy; a live one
is killed only when its probes fail N times in a row, and only the engine that was started is trusted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tiers import supervisor
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.replica import Replica
from tiers.supervisor import EngineProcess

STUB_ENGINE = Path(__file__).resolve().parent / "stub_engine.py"
FAST = {"health_every_s": 0.1, "probe_timeout_s": 0.3, "failures_to_kill": 3}  # the policy, at test speed


class StubEngineProcess(EngineProcess):
    """Runs a stub engine (a tiny HTTP server with /health) instead of a model; `mode_file` makes it sick."""

    mode_file: Path | None = None

    def command(self, port: int) -> list[str]:
        return [sys.executable, str(STUB_ENGINE), str(port), *([str(self.mode_file)] if self.mode_file else [])]


def built_model(tmp_path: Path) -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    return model_dir


def record_marks(replica: Replica) -> list[tuple[str, str]]:
    """Every (status, reason) the replica is given from now on, in order."""
    seen: list[tuple[str, str]] = []
    mark = replica.mark

    def recording(status: str, reason: str) -> None:
        seen.append((status, reason))
        mark(status, reason)

    replica.mark = recording  # type: ignore[method-assign]
    return seen


def spec(model: str) -> TierSpec:
    return TierSpec(name="mid", backend="local", model=model, price_per_1k_input="0", price_per_1k_output="0",
                    hardware_cost_per_hour="0", context_limit=1024)


async def wait_until(cond, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_crashed_engine_is_restarted(tmp_path: Path) -> None:
    client = TierClient()
    replica = Replica("mid", 0)
    proc = StubEngineProcess(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path, log_dir=tmp_path / "logs",
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

    from assets.builds import build_lock, work_dir_for

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


@pytest.mark.parametrize(("sickness", "symptom"), [("dead", "/health answered 503"), ("hang", "no answer")])
async def test_an_engine_that_fails_n_probes_in_a_row_is_killed_and_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sickness: str, symptom: str) -> None:
    monkeypatch.setattr(supervisor, "BACKOFF_START_S", 0.1)
    client = TierClient()
    replica = Replica("mid", 0)
    marks = record_marks(replica)
    proc = StubEngineProcess(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path,
                             log_dir=tmp_path / "logs", client=client, start_timeout_s=0.5, **FAST)
    proc.mode_file = tmp_path / "mode"
    task = asyncio.create_task(proc.run())
    try:
        await wait_until(lambda: replica.healthy)
        first_pid = proc.proc.pid  # type: ignore[union-attr]
        await asyncio.sleep(0.6)  # past the start-up deadline: from now on only the probes decide
        proc.mode_file.write_text(sickness)
        await wait_until(lambda: replica.restarts == 1)
        proc.mode_file.write_text("ok")
        await wait_until(lambda: replica.healthy)
        assert proc.proc.pid != first_pid  # type: ignore[union-attr]
        failing = [i for i, (_, reason) in enumerate(marks) if reason.startswith("health probe failed")]
        assert failing, marks
        (s1, r1), (s2, r2), (s3, r3), (s4, r4) = marks[failing[0]:failing[0] + 4]
        assert (s1, s2) == ("ready", "ready") and "(1 of 3" in r1 and "(2 of 3" in r2  # still routed to
        assert s3 == "down" and r3.startswith("engine killed: 3 health probes failed in a row") and symptom in r3
        assert s4 == "down" and "restarting in" in r4
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()


async def test_one_slow_probe_after_ready_marks_nothing_down_and_kills_nothing(tmp_path: Path) -> None:
    client = TierClient()
    replica = Replica("mid", 0)
    proc = StubEngineProcess(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path,
                             log_dir=tmp_path / "logs", client=client, start_timeout_s=0.5, **FAST)
    proc.mode_file = tmp_path / "mode"
    task = asyncio.create_task(proc.run())
    try:
        await wait_until(lambda: replica.healthy)
        first_pid = proc.proc.pid  # type: ignore[union-attr]
        await asyncio.sleep(0.6)  # past the start-up deadline, which must no longer kill an unanswered probe
        marks = record_marks(replica)
        proc.mode_file.write_text("hang-once")
        await wait_until(lambda: "(1 of 3" in replica.reason)
        await wait_until(lambda: replica.reason == "")
        assert replica.healthy and replica.restarts == 0 and proc.proc.pid == first_pid  # type: ignore[union-attr]
        assert {status for status, _ in marks} == {"ready"}
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()


async def test_a_stranger_answering_on_the_engine_port_is_never_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[str] = []

    class Stranger(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            probes.append(self.path)
            body = json.dumps({"status": "ok", "instance": "someone-else"}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class SilentEngine(EngineProcess):
        """An engine still loading: it never binds the port, which the stranger took first."""

        def command(self, port: int) -> list[str]:
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    stranger = ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=stranger.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    monkeypatch.setattr(supervisor, "free_port", lambda: stranger.server_port)
    client = TierClient()
    replica = Replica("mid", 0)
    marks = record_marks(replica)
    proc = SilentEngine(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path, log_dir=tmp_path / "logs",
                        client=client, start_timeout_s=1.0, **FAST)
    task = asyncio.create_task(proc.run())
    try:
        await wait_until(lambda: replica.restarts == 1)  # the start-up deadline passed: killed, not trusted
        assert len(probes) >= 5 and set(probes) == {"/health"}  # the stranger did answer the probes
        assert not replica.ever_ready and "ready" not in {status for status, _ in marks}
        assert replica.status == "down" and "another instance" in replica.reason
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()
        stranger.shutdown()
        stranger.server_close()


async def test_each_start_passes_a_fresh_instance_nonce_to_its_engine(tmp_path: Path) -> None:
    client = TierClient()
    replica = Replica("mid", 0)
    proc = StubEngineProcess(spec(str(built_model(tmp_path))), replica, models_dir=tmp_path,
                             log_dir=tmp_path / "logs", client=client, start_timeout_s=30, **FAST)
    task = asyncio.create_task(proc.run())
    try:
        await wait_until(lambda: replica.healthy)
        first = proc.instance
        health = await client.get_json(f"{replica.url}/health")
        assert health["instance"] == first and len(first) == 32
        os.kill(proc.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        await wait_until(lambda: replica.restarts == 1 and replica.healthy)
        assert proc.instance != first
    finally:
        await proc.stop()
        task.cancel()
        await client.aclose()
