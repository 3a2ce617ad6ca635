"""Spawns and watches local engine processes, one per tier replica, restarting a crashed one with backoff.

An engine crash is a tier outage (its replica turns unhealthy and the router goes around it), never a
gateway crash. A tier whose model is not built yet (the distilled student) waits, marked unavailable,
and starts by itself once its model directory appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from pathlib import Path

from engine.model_source import is_prepared, resolve_model
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.errors import TierError
from tiers.replica import Replica
from tiers.students import build_progress

log = logging.getLogger("tiergate.supervisor")
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # an engine up this long resets the backoff
HEALTH_EVERY_S = 1.0
MODEL_POLL_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    def __init__(self, spec: TierSpec, replica: Replica, *, models_dir: Path, log_dir: Path,
                 client: TierClient, start_timeout_s: float) -> None:
        self.spec = spec
        self.replica = replica
        self.models_dir = models_dir
        self.log_path = log_dir / f"engine-{spec.name}-{replica.index}.log"
        self.client = client
        self.start_timeout_s = start_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self._stopping = False

    def command(self, port: int) -> list[str]:
        spec = self.spec
        cmd = [sys.executable, "-m", "gateway.cli.main", "engine", "serve",
               "--model", str(resolve_model(spec.model, self.models_dir)), "--served-name", spec.name,
               "--port", str(port), "--dtype", spec.dtype, "--device", spec.device,
               "--max-num-seqs", str(spec.max_num_seqs), "--models-dir", str(self.models_dir)]
        if spec.quantize:
            cmd += ["--quantize", spec.quantize]
        if spec.threads:
            cmd += ["--threads", str(spec.threads)]
        if spec.kv_cache_bytes:
            cmd += ["--kv-cache-bytes", str(spec.kv_cache_bytes)]
        if spec.kv_cache_dtype != "auto":
            cmd += ["--kv-cache-dtype", spec.kv_cache_dtype]
        return cmd

    async def run(self) -> None:
        backoff = BACKOFF_START_S
        while not self._stopping:
            if not is_prepared(self.spec.model, self.models_dir):
                self._mark_unbuilt()
                await asyncio.sleep(MODEL_POLL_S)
                continue
            started = time.monotonic()
            rc = await self._run_once()
            if self._stopping:
                return
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = BACKOFF_START_S
            self.replica.restarts += 1
            self.replica.mark("down", f"engine exited with code {rc}; restarting in {backoff:.0f}s")
            log.warning("tier %s replica %d: engine exited with code %s; restart %d in %.0fs (log: %s)",
                        self.spec.name, self.replica.index, rc, self.replica.restarts, backoff, self.log_path)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _mark_unbuilt(self) -> None:
        """Preparing (a build is running: say how far) or unavailable (say which command builds it)."""
        progress = build_progress(resolve_model(self.spec.model, self.models_dir))
        if progress is None:
            how = f"; build it with `{self.spec.prepared_by}`" if self.spec.prepared_by else ""
            self.replica.mark("unavailable", f"model {self.spec.model!r} is not built yet{how}")
            return
        done = ""
        if progress.get("budget_s"):
            share = min(1.0, progress["train_s"] / progress["budget_s"])
            done = f" {share:.0%} of its {progress['budget_s']:.0f}s budget"
        elif progress.get("steps"):
            done = f" step {progress['step']} of {progress['steps']}"
        agree = f", top-1 agreement {progress['agree']:.0%} on its last batch" if "agree" in progress else ""
        self.replica.mark("preparing", f"model {self.spec.model!r} is being distilled:{done or ' starting'}{agree}")

    async def _run_once(self) -> int | None:
        port = free_port()
        self.replica.url = f"http://127.0.0.1:{port}"
        self.replica.mark("starting", "engine is loading its model")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(port), stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf)
        waiter = asyncio.ensure_future(self.proc.wait())
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not waiter.done():
                healthy = await self._probe()
                if healthy and not self.replica.healthy:
                    log.info("tier %s replica %d ready at %s", self.spec.name, self.replica.index, self.replica.url)
                    self.replica.mark("ready", "")
                elif not healthy and self.replica.healthy:
                    self.replica.mark("down", "engine stopped answering /health")
                if not self.replica.healthy and time.monotonic() > deadline:
                    log.error("tier %s replica %d not healthy after %.0fs; killing it",
                              self.spec.name, self.replica.index, self.start_timeout_s)
                    self.proc.kill()
                await asyncio.wait([waiter], timeout=HEALTH_EVERY_S)
            return waiter.result()
        finally:
            self.replica.healthy = False
            if not waiter.done():
                waiter.cancel()

    async def _probe(self) -> bool:
        try:
            health = await self.client.get_json(f"{self.replica.url}/health", timeout_s=2.0)
        except TierError:
            return False
        if isinstance(health.get("model_version"), str):
            self.replica.model_version = health["model_version"]
        stats = health.get("stats")
        if isinstance(stats, dict):
            self.replica.stats = {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
        return True

    async def stop(self) -> None:
        self._stopping = True
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
