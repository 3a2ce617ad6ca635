"""Spawns and watches local engine processes, one per tier replica (of each version of a tier with versions),
restarting a crashed one with backoff.

An engine crash is a tier outage (its replica turns unhealthy and the router goes around it), never a
gateway crash. A tier whose model is not built yet (the distilled student) waits, marked unavailable,
and starts by itself once its model directory appears.

Health policy. Until its first ready an engine has `start_timeout_s` to answer /health (loading a model takes a
while); after that the deadline no longer applies and only the probes decide. A probe fails on a connection error,
on no answer within PROBE_TIMEOUT_S, on any status but 200 (an engine whose loop died answers 503 {"status":
"dead"}, one wedged in a step or a grammar compile 503 {"status": "unhealthy"}), or on a body that is not this
start's instance. An engine is killed and restarted after HEALTH_FAILURES_TO_KILL (3) failed probes in a row, at one
probe every HEALTH_EVERY_S (1 s): about 3 s for an engine that refuses or answers 503, about 9 s for one that hangs.
Fewer failures mark nothing down: the replica stays ready, and routed to, with the failures counted in its reason,
because one slow probe (a long prefill, a pause) is not an outage, and requests that do fail trip the replica's
circuit breaker on their own. The replica is marked down when the engine is killed.

Trust. Each start gets a random nonce, passed in ENGINE_INSTANCE_ENV; a /health counts only when its JSON
says `"instance"` is that nonce, so a stranger that took the port in the race between `free_port` and the
engine's bind is never taken for the engine. Engines die with the gateway, even a SIGKILLed one
(assets/parent_watch.py); they are spawned from the event loop's thread, which lives until `stop()` has ended them.

Capacity. An engine is given its share of the host's cores (`CoreShare`, planned by tiers/fleet.py): its
affinity is set in the child before it runs anything, and its torch and OpenMP thread counts match the share,
so co-located engines never spin on each other's cores. Its `--max-num-seqs` is what its KV cache holds for
a typical request (`engine_max_num_seqs`), the same number the gateway gives the tier's dispatch queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from assets.builds import build_progress
from assets.engine_key import ENGINE_API_KEY_ENV
from assets.model_dtype import auto_dtype
from assets.model_source import is_prepared, resolve_model
from assets.parent_watch import ENGINE_INSTANCE_ENV, die_with_parent
from quotas.fault_log import FaultLog
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.errors import TierError, UpstreamRejected
from tiers.replica import Replica

log = logging.getLogger("tiergate.supervisor")


class EngineDown(Exception):
    """Why an engine's run ended (it exited, or was killed), as its crash loop's FaultLog logs it."""
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # an engine up this long resets the backoff
HEALTH_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0
HEALTH_FAILURES_TO_KILL = 3  # failed probes in a row, after the first ready, before a restart
MODEL_POLL_S = 5.0
# The engine's own sizing rule (engine/launch.py: TYPICAL_REQUEST_TOKENS, MAX_NUM_SEQS_CAP; engine/model_runner.py:
# DEFAULT_KV_CACHE_BYTES, DEFAULT_BLOCK_SIZE), restated here because the gateway never imports the engine;
# tests/tiers/test_engine_capacity.py checks both give the same number
TYPICAL_REQUEST_TOKENS = 1024
MAX_NUM_SEQS_CAP = 256
ENGINE_KV_CACHE_BYTES = 512 << 20
KV_BLOCK_SIZE = 16
UNSIZED_MAX_NUM_SEQS = 8  # a model not built yet (the student) has no config to size from
# An engine's body limit is the gateway's plus this: the body the gateway forwards is its tenant's re-encoded, with
# fields of its own set, so one at the gateway's limit may come out a little longer (the engine's 413 would reach the
# tenant as a 400 naming the engine's limit, tiers/errors.py REQUEST_FAULT_STATUSES, for a body the gateway took)
FORWARD_MARGIN_BYTES = 64 << 10


@dataclass(frozen=True)
class CoreShare:
    """The CPUs one engine may run on and the threads it runs there (tiers/core_plan.py's `plan_cores`)."""

    cores: tuple[int, ...]  # CPU ids, set as the child's affinity before it starts
    threads: int  # torch and OpenMP threads: the share's size (1 where replicas share a core)
    shared_with: tuple[str, ...] = ()  # other replicas ("mid/0") on the same cores: more replicas than cores

    def public(self) -> dict[str, object]:
        return {"cores": list(self.cores), "threads": self.threads, "shares_cores_with": list(self.shared_with)}


def engine_max_num_seqs(spec: TierSpec, models_dir: Path) -> int:
    """Sequences an engine of `spec` runs at once: the tier's `max_num_seqs`, else the typical requests
    (TYPICAL_REQUEST_TOKENS each) its KV cache holds, capped, read from the model's config.json without torch."""
    if spec.max_num_seqs:
        return spec.max_num_seqs
    try:
        raw = json.loads((resolve_model(spec.model, models_dir) / "config.json").read_text())
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        bytes_per_token = 2 * int(raw["num_hidden_layers"]) * kv_heads * head_dim * _kv_itemsize(spec)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return UNSIZED_MAX_NUM_SEQS
    num_blocks = (spec.kv_cache_bytes or ENGINE_KV_CACHE_BYTES) // (KV_BLOCK_SIZE * bytes_per_token)
    return max(1, min(MAX_NUM_SEQS_CAP, num_blocks // -(-TYPICAL_REQUEST_TOKENS // KV_BLOCK_SIZE)))


def _kv_itemsize(spec: TierSpec) -> int:
    """Bytes per KV element, as the engine resolves its dtypes (engine/model_runner.py's resolve_*_dtype)."""
    if spec.kv_cache_dtype == "bf16":
        return 2
    dtype = auto_dtype(spec.device, spec.quantize) if spec.dtype == "auto" else spec.dtype
    return 4 if dtype == "fp32" else 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    def __init__(self, spec: TierSpec, replica: Replica, *, models_dir: Path, log_dir: Path,
                 client: TierClient, start_timeout_s: float, health_every_s: float = HEALTH_EVERY_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, failures_to_kill: int = HEALTH_FAILURES_TO_KILL,
                 cores: CoreShare | None = None, max_body_bytes: int | None = None) -> None:
        """`cores` None: no affinity, and torch's own thread count (the core budget is off). `max_body_bytes`: the
        gateway's body limit, which the engine's follows (None: the engine's default, the gateway's default)."""
        self.max_body_bytes = max_body_bytes
        self.spec = spec
        self.replica = replica
        self.models_dir = models_dir
        self.label = replica.tier  # the tier's name, with `@version` for a version other than the serving one
        self.log_path = log_dir / f"engine-{self.label}-{replica.index}.log"
        self.client = client
        self.start_timeout_s = start_timeout_s
        self.health_every_s = health_every_s
        self.probe_timeout_s = probe_timeout_s
        self.failures_to_kill = failures_to_kill
        self.cores = cores
        self.max_num_seqs = engine_max_num_seqs(spec, models_dir)  # read once: the dispatch queue's size agrees
        self.proc: asyncio.subprocess.Process | None = None
        self.instance = ""  # this start's nonce, which the engine's /health must report
        self._kill_reason: str | None = None
        self._stopping = False
        # a crash loop in the log: each reason once, then one line when it is ready again (not a line a restart)
        self._crashes = FaultLog(log, f"tier {self.label} replica {replica.index}: its engine", known=(EngineDown,),
                                 rounds="starts")

    def command(self, port: int) -> list[str]:
        spec = self.spec
        cmd = [sys.executable, "-m", "gateway.cli.main", "engine", "serve",
               "--model", str(resolve_model(spec.model, self.models_dir)), "--served-name", spec.name,
               "--port", str(port), "--dtype", spec.dtype, "--device", spec.device,
               "--max-num-seqs", str(self.max_num_seqs), "--models-dir", str(self.models_dir)]
        if spec.quantize:
            cmd += ["--quantize", spec.quantize]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if spec.kv_cache_bytes:
            cmd += ["--kv-cache-bytes", str(spec.kv_cache_bytes)]
        if spec.kv_cache_dtype != "auto":
            cmd += ["--kv-cache-dtype", spec.kv_cache_dtype]
        if (draft := spec.draft) is not None:
            cmd += ["--draft-model", str(resolve_model(draft.model, self.models_dir)), "--draft-dtype", draft.dtype,
                    "--speculative-k", str(spec.speculative.k),
                    "--speculative-max-batch", str(spec.speculative.max_batch)]
            if draft.quantize:
                cmd += ["--draft-quantize", draft.quantize]
        if self.max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(self.max_body_bytes + FORWARD_MARGIN_BYTES)]
        return cmd

    def _models(self) -> list[str]:
        """The models the engine loads: the tier's, and its speculative draft's."""
        draft = self.spec.draft
        return [self.spec.model] + ([draft.model] if draft is not None else [])

    @property
    def threads(self) -> int | None:
        """The engine's torch threads: the tier's `threads`, else its share's, else torch's choice (None)."""
        return self.spec.threads or (self.cores.threads if self.cores else None)

    def env(self) -> dict[str, str]:
        """The child's environment: ours, this start's nonce, and thread pools (libgomp, MKL) the engine's size,
        set before torch reads them. Not the engine key a gateway may hold for a remote engine: a local engine
        serves 127.0.0.1 with no key, and the gateway sends its local tiers none."""
        pools = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)} if self.threads else {}
        ours = {k: v for k, v in os.environ.items() if k != ENGINE_API_KEY_ENV}
        return ours | pools | {ENGINE_INSTANCE_ENV: self.instance}

    def preexec(self) -> Callable[[], None] | None:
        """Runs in the child before the engine: die with the gateway, and stay on this share's cores."""
        die = die_with_parent()
        if self.cores is None:
            return die
        cores = self.cores.cores

        def preexec() -> None:
            if die is not None:
                die()
            os.sched_setaffinity(0, cores)

        return preexec

    async def run(self) -> None:
        backoff = BACKOFF_START_S
        while not self._stopping:
            if not all(is_prepared(model, self.models_dir) for model in self._models()):
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
            why = self._kill_reason or f"engine exited with code {rc}"
            self.replica.mark("down", f"{why}; restarting in {backoff:.0f}s")
            self._crashes.failed(EngineDown(f"{self._portless(why)}; restarting with backoff up to "
                                            f"{BACKOFF_MAX_S:g}s (log: {self.log_path})"))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _portless(self, text: str) -> str:
        """`text` without this start's port (each start takes a free one), so the same fault reads the same in the
        crash loop's log (`_crashes`: once)."""
        port = (self.replica.url or "").rpartition(":")[2]
        return re.sub(rf"\b{port}\b", "<port>", text) if port.isdigit() else text

    def _mark_unbuilt(self) -> None:
        """Preparing (a build is running: say how far) or unavailable (say which command builds it)."""
        draft = self.spec.draft
        if draft is not None and is_prepared(self.spec.model, self.models_dir):  # the draft is what is missing
            how = f"; build it with `{draft.prepared_by}`" if draft.prepared_by else ""
            self.replica.mark("unavailable", f"its speculative draft, tier {draft.name!r}'s model {draft.model!r}, "
                                             f"is not built yet{how}")
            return
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
        self.instance = secrets.token_hex(16)
        self._kill_reason = None
        self.replica.mark("starting", "engine is loading its model")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command(port), stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                env=self.env(), preexec_fn=self.preexec())
        if self._stopping:  # stop() came while it was being spawned
            self.proc.terminate()
        waiter = asyncio.ensure_future(self.proc.wait())
        try:
            await self._watch(self.proc, waiter)
            return waiter.result()
        finally:
            self.replica.healthy = False
            if not waiter.done():
                waiter.cancel()

    async def _watch(self, proc: asyncio.subprocess.Process, waiter: asyncio.Future[int]) -> None:
        """Probe until the process exits, killing it past the start-up deadline or after too many failed probes."""
        deadline = time.monotonic() + self.start_timeout_s
        ready_once = False
        failures = 0
        while not waiter.done() and self._kill_reason is None:
            problem = await self._probe()
            if waiter.done() or self._stopping:  # it exited while being probed (run() reports its exit code), or
                break  # is being stopped: a probe failing now is no fault
            if problem is None:
                failures = 0
                if not self.replica.healthy or self.replica.reason:
                    if not ready_once and self._crashes.failures:
                        self._crashes.ok()  # the line that ends a crash loop's
                    elif not ready_once:
                        log.info("tier %s replica %d ready at %s", self.label, self.replica.index,
                                 self.replica.url)
                    self.replica.mark("ready", "")
                ready_once = True
            elif not ready_once:
                if time.monotonic() > deadline:
                    self._kill(proc, f"engine not ready after {self.start_timeout_s:.0f}s (last probe: {problem})")
            else:
                failures += 1
                if failures >= self.failures_to_kill:
                    self._kill(proc, f"{failures} health probes failed in a row (last: {problem})")
                else:
                    log.warning("tier %s replica %d: health probe failed (%d of %d before a restart): %s",
                                self.label, self.replica.index, failures, self.failures_to_kill, problem)
                    self.replica.mark("ready", f"health probe failed ({failures} of {self.failures_to_kill} "
                                               f"before a restart): {problem}")
            await asyncio.wait([waiter], timeout=self.health_every_s)
        await waiter

    def _kill(self, proc: asyncio.subprocess.Process, reason: str) -> None:
        """Logged as `run` restarts it (once in a crash loop: `_crashes`)."""
        self._kill_reason = f"engine killed: {reason}"
        self.replica.mark("down", self._kill_reason)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    async def _probe(self) -> str | None:
        """None when this start's engine answered /health; otherwise what was wrong."""
        return await probe_engine(self.client, self.replica, self.instance, timeout_s=self.probe_timeout_s)

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


async def probe_engine(client: TierClient, replica: Replica, instance: str, *, timeout_s: float) -> str | None:
    """Probe the engine at `replica.url`: None when the start whose nonce is `instance` answered /health (its model
    version and stats are then copied onto `replica`); otherwise what was wrong. The supervisor probes the engines it
    started; the workers of `tiergate serve --workers N` probe the ones their parent published."""
    try:
        health = await client.get_json(f"{replica.url}/health", timeout_s=timeout_s)
    except UpstreamRejected as exc:
        return f"/health answered {exc.status}: {exc}"
    except TierError as exc:
        return str(exc)
    except ValueError:
        return "/health answered 200 with a body that is not JSON"
    if not isinstance(health, dict) or health.get("instance") != instance:
        return "/health answered for another instance (not the engine this supervisor started)"
    if isinstance(health.get("model_version"), str):
        replica.model_version = health["model_version"]
    stats = health.get("stats")
    if isinstance(stats, dict):
        replica.stats = {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
    return None
