"""`tiergate serve` as the benchmarks that need a whole gateway start it: a process group of its own, ready once
it prints its keys (the admin key and the demo tenant's, which the benchmark then uses), stopped with SIGTERM
(SIGKILL after 30 s) whatever happens."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "Or with the OpenAI Python client"  # the last line of the banner, after the keys


@dataclass
class Started:
    proc: subprocess.Popen[str]
    admin_key: str
    demo_key: str
    output: list[str]  # everything it printed, still growing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def tiergate_serve(env: dict[str, str], *, ready_timeout_s: float) -> Iterator[Started]:
    """Run `python -m gateway.cli.main serve` with `env` until the block ends; raises RuntimeError (with its last
    lines) if it exits or prints no keys within `ready_timeout_s`."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve"], env=env, text=True, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(proc.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline = time.time() + ready_timeout_s
        while not any(READY_LINE in line for line in output):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("tiergate serve did not become ready:\n" + "".join(output[-40:]))
            time.sleep(0.5)
        text = "".join(output)
        admin = re.search(r"admin key\s+: (tg-\S+)", text).group(1)  # type: ignore[union-attr]
        demo = re.search(r"demo key\s+: (tg-\S+)", text).group(1)  # type: ignore[union-attr]
        yield Started(proc, admin, demo, output)
    finally:
        with suppress(ProcessLookupError):  # gone already (it failed to start)
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
