"""Engines and first-use build children die with the gateway, even when the gateway is SIGKILLed and runs no
clean-up: a real parent process spawns a child through the gateway's own code, is killed, and the child goes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB_ENGINE = Path(__file__).resolve().parent / "stub_engine.py"
GONE_WITHIN_S = 5.0

# the gateway's supervisor, running a stub engine (which has no watchdog of its own)
SUPERVISOR_PARENT = """
import asyncio, sys
from pathlib import Path
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.replica import Replica
from tiers.supervisor import EngineProcess

pidfile, model_dir, stub = sys.argv[1:4]

class Stub(EngineProcess):
    def command(self, port):
        return [sys.executable, stub, str(port)]

async def main():
    spec = TierSpec(name="mid", backend="local", model=model_dir, price_per_1k_input="0",
                    price_per_1k_output="0", hardware_cost_per_hour="0", context_limit=1024)
    replica = Replica("mid", 0)
    engine = Stub(spec, replica, models_dir=Path(model_dir).parent, log_dir=Path(pidfile).parent,
                  client=TierClient(), start_timeout_s=30, health_every_s=0.1)
    task = asyncio.create_task(engine.run())
    while not replica.healthy:
        await asyncio.sleep(0.05)
    Path(pidfile + ".tmp").write_text(str(engine.proc.pid))
    Path(pidfile + ".tmp").rename(pidfile)
    await task

asyncio.run(main())
"""

# a child that says who it is and then lives on, as a long build would
LONG_CHILD = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1] + ".tmp").write_text(str(os.getpid()))
Path(sys.argv[1] + ".tmp").rename(sys.argv[1])
time.sleep(120)
"""

# `tiergate serve`'s first-use builds, with the build command replaced by LONG_CHILD
FIRST_USE_PARENT = """
import sys, time
from pathlib import Path
from gateway.cli import first_use
from gateway.settings import Settings

pidfile, data_dir, child = sys.argv[1:4]
first_use.build_commands = lambda settings, catalogue: [[sys.executable, "-c", child, pidfile]]
first_use.start_background_builds(Settings(data_dir=Path(data_dir), build_missing_models=True), None)
time.sleep(120)
"""

# an engine process as the supervisor starts it, loading its model, under a parent that asked for no
# parent-death signal: only the engine's own watchdog can end it
ENGINE_WHILE_LOADING = """
import os, sys, time
from pathlib import Path
import engine.launch as launch

def loading(*args, **kwargs):
    Path(sys.argv[1] + ".tmp").write_text(str(os.getpid()))
    Path(sys.argv[1] + ".tmp").rename(sys.argv[1])
    time.sleep(120)

launch.build_engine = loading
launch.serve("model", Path("."), host="127.0.0.1", port=0)
"""
PLAIN_PARENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]],
                 env=os.environ | {"TIERGATE_ENGINE_INSTANCE": "nonce"})
time.sleep(120)
"""


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger where nothing reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


def child_outlives_killed_parent(tmp_path: Path, script: str, *args: str) -> bool:
    """Start `script` as the parent, wait for its child's pid, SIGKILL the parent: is the child still running?"""
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", script, str(pidfile), *args], cwd=ROOT)
    child = None
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists():
            assert parent.poll() is None, f"the parent exited with {parent.returncode}"
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert is_running(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while is_running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        return is_running(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and is_running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_an_engine_dies_with_its_sigkilled_supervisor(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    assert not child_outlives_killed_parent(tmp_path, SUPERVISOR_PARENT, str(model_dir), str(STUB_ENGINE))


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_first_use_build_dies_with_its_sigkilled_gateway(tmp_path: Path) -> None:
    assert not child_outlives_killed_parent(tmp_path, FIRST_USE_PARENT, str(tmp_path / "data"), LONG_CHILD)


def test_a_supervised_engine_exits_on_its_own_when_its_parent_is_gone(tmp_path: Path) -> None:
    assert not child_outlives_killed_parent(tmp_path, PLAIN_PARENT, ENGINE_WHILE_LOADING)
