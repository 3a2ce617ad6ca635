"""`tiergate serve --workers N`: N gateway processes on one port, the local engines supervised once.

- **One port, connections spread evenly.** Each worker listens on a socket of its own bound with SO_REUSEPORT,
  and the kernel hands each new connection to one of them by a hash of its addresses. One listening socket shared
  by every worker (what uvicorn's `workers=` does) lets whichever process wakes first accept: measured here with
  two workers, 64 keep-alive connections went 61 to 3 (shared) against 28-36 to 36-28 (SO_REUSEPORT). This
  process holds the port (bound, not listening, so nothing else takes it while a worker restarts).
- **Engines once.** This process runs the local engines' supervisor (tiers/fleet.py, tiers/supervisor.py) and the
  first-use builds, and publishes each engine's URL, nonce and status in `<data dir>/engines.json`; a worker
  follows that file and probes the engines itself (tiers/engines_file.py), and never starts one.
- **Exact across workers.** Quotas need TIERGATE_REDIS_URL (`require_shared_quotas`): the memory backend counts
  in each process, so N workers would admit up to N times a limit. With Redis set, quotas, the cache's entries,
  the ladder's level and idempotency records are in Redis; the ledger and tenants are SQLite files in WAL mode
  (or PostgreSQL), which several processes share safely. Per worker: ceil(capacity / N) dispatch slots of each
  tier (gateway/app.py's `tier_capacity`), its fair-share order among the tenants it serves, the cheap tenant
  gate (a lower bound of the exact limits), circuit breakers and replica affinity.
- **Cores.** With local engines, workers run on the gateway's share of the host (TIERGATE_GATEWAY_CORES, by
  default N cores with N workers; `host_core_budget`), the engines on theirs.
- **Lifetimes.** Workers die with this process even when it is SIGKILLed (PR_SET_PDEATHSIG, plus a watch for
  re-parenting in the worker). SIGTERM or SIGINT here stops the workers (each finishes its requests, 5 s at most,
  and writes its ledger), then the engines. A worker that exits is restarted with backoff; one that fails its
  very first start (uvicorn's startup failure) stops everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import httpx

from assets.parent_watch import die_with_parent, exit_when_orphaned
from gateway.bootstrap import banner
from gateway.settings import Settings
from gateway.worker_metrics import METRICS_DIR_ENV, forget_process, fresh_metrics_dir
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.engines_file import ENGINES_FILE, publish_engines, remove_published, write_document
from tiers.fleet import Fleet, host_core_budget

log = logging.getLogger("tiergate.workers")
WORKER_SETTINGS_ENV = "TIERGATE_WORKER_SETTINGS"  # the parent's Settings as JSON: a worker reads nothing else
WORKER_INDEX_ENV = "TIERGATE_WORKER_INDEX"
STARTUP_FAILURE = 3  # a worker whose server never started (uvicorn's code for it)
STOP_GRACE_S = 30.0  # a worker's graceful stop (5 s of requests, then its ledger and stores) before SIGKILL
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a worker up this long resets the backoff
LISTEN_BACKLOG = 2048


class WorkerStartError(RuntimeError):
    """A worker failed its first start: every worker would (the app, a store, or the port is broken)."""


def require_shared_quotas(settings: Settings) -> None:
    """Several workers need Redis for exact quotas; raises click's usage error naming the setting."""
    if settings.workers > 1 and not settings.redis_url:
        raise click.UsageError(
            f"--workers {settings.workers} needs TIERGATE_REDIS_URL (redis://host:port/db): without Redis each "
            f"gateway process counts quotas (requests and tokens per minute, budgets, concurrency) in its own memory, "
            f"so {settings.workers} workers would admit up to {settings.workers} times every limit. Set it, or run "
            f"one worker.")


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold `host:port` for the workers' SO_REUSEPORT sockets, failing if anything else has it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # conflicts with any socket on the port
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc.strerror}"
            raise click.ClickException(f"{host}:{port} {why}") from exc
    guard = socket.socket(family, socket.SOCK_STREAM)
    guard.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    guard.bind((host, port))
    return guard


def worker_socket(host: str, port: int) -> socket.socket:
    """A worker's own socket in the port's SO_REUSEPORT group, bound but not listening: uvicorn listens once the
    app has started, so the kernel never hands a connection to a worker still loading (a restarted one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def gateway_cores(catalogue: TierCatalogue, engine_cores: list[int] | None) -> list[int] | None:
    """The CPUs workers run on: the host's less the engines' budget, when there are local engines to keep off."""
    if engine_cores is None or not any(t.backend == "local" for t in catalogue.tiers.values()):
        return None
    return sorted(set(os.sched_getaffinity(0)) - set(engine_cores)) or None


def run_workers(settings: Settings, catalogue: TierCatalogue, keys: dict[str, str] | None) -> None:
    """Serve until SIGTERM or SIGINT (the parent's whole life); raises click's error when a worker cannot start."""
    guard = reserve_port(settings.host, settings.port)
    try:
        asyncio.run(_Parent(settings, catalogue, keys).run())
    except WorkerStartError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        guard.close()


class _Worker:
    """One gateway process, restarted when it exits until `stop`."""

    def __init__(self, index: int, settings: Settings, cores: list[int] | None, metrics_dir: Path) -> None:
        self.index = index
        self.env = os.environ | {WORKER_SETTINGS_ENV: settings.model_dump_json(), WORKER_INDEX_ENV: str(index),
                                 METRICS_DIR_ENV: str(metrics_dir)}
        self.cores = cores
        self.metrics_dir = metrics_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False

    def preexec(self) -> Callable[[], None]:
        """In the child: die with the parent (even SIGKILLed), and stay on the gateway's cores."""
        die = die_with_parent()
        cores = self.cores

        def preexec() -> None:
            if die is not None:
                die()
            if cores:
                os.sched_setaffinity(0, cores)

        return preexec

    async def keep_running(self) -> None:
        backoff, first = BACKOFF_START_S, True
        while not self.stopping:
            started = time.monotonic()
            # its own process group: a terminal's Ctrl-C reaches the parent, which stops workers one signal each
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.workers", stdin=asyncio.subprocess.DEVNULL, env=self.env,
                preexec_fn=self.preexec(), process_group=0)
            if self.stopping:  # stop() came while it was being spawned
                self.proc.terminate()
            rc = await self.proc.wait()
            forget_process(self.metrics_dir, self.proc.pid)
            if self.stopping:
                return
            if first and rc == STARTUP_FAILURE:
                raise WorkerStartError(f"gateway worker {self.index} failed to start (its log is above)")
            first = False
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = BACKOFF_START_S
            log.warning("gateway worker %d (pid %d) exited with code %s; restarting it in %.0fs", self.index,
                        self.proc.pid, rc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def stop(self) -> None:
        self.stopping = True
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=STOP_GRACE_S)
        except TimeoutError:
            log.error("gateway worker %d (pid %d) did not stop in %.0fs; killing it", self.index, proc.pid,
                      STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class _Parent:
    def __init__(self, settings: Settings, catalogue: TierCatalogue, keys: dict[str, str] | None) -> None:
        self.settings = settings
        self.catalogue = catalogue
        self.keys = keys
        self.engines_file = settings.data_dir / ENGINES_FILE

    async def run(self) -> None:
        s = self.settings
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        client = TierClient(connect_timeout_s=s.upstream_connect_timeout_s, read_timeout_s=s.upstream_read_timeout_s)
        fleet = Fleet(self.catalogue, client, models_dir=s.resolved_models_dir, log_dir=s.data_dir / "logs",
                      start_timeout_s=s.engine_start_timeout_s, core_budget=host_core_budget(workers=s.workers),
                      max_body_bytes=s.max_body_bytes)
        write_document(self.engines_file, fleet.published())  # before any worker reads it
        cores = gateway_cores(self.catalogue, fleet.core_budget)
        worker_settings = s.model_copy(update={"engines_file": self.engines_file})
        metrics_dir = fresh_metrics_dir(s.data_dir / "metrics")
        workers = [_Worker(i, worker_settings, cores, metrics_dir) for i in range(s.workers)]
        log.info("%d gateway workers on %s:%d (SO_REUSEPORT), %s", s.workers, s.host, s.port,
                 f"on cores {','.join(map(str, cores))}" if cores else "unpinned")
        publisher = asyncio.create_task(publish_engines(self.engines_file, fleet.published))
        await fleet.start()
        running = [asyncio.create_task(w.keep_running(), name=f"worker-{w.index}") for w in workers]
        announce = asyncio.create_task(self._announce_when_ready(fleet))
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([stopped, *running], return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if t is not stopped and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
        finally:
            announce.cancel()
            log.info("stopping %d gateway workers, then the local engines", len(workers))
            await asyncio.gather(*(w.stop() for w in workers))
            for task in (*running, stopped):
                task.cancel()
            await fleet.stop()
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher
            remove_published(self.engines_file)
            await client.aclose()

    async def _announce_when_ready(self, fleet: Fleet) -> None:
        """Print the banner once a worker answers ready (the public /health), as one-process `serve` does."""
        s = self.settings
        last = ""
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                await asyncio.sleep(1.0)
                try:
                    ready = (await http.get(f"http://{s.host}:{s.port}/health")).status_code == 200
                except httpx.HTTPError:
                    continue
                if ready:
                    for name, why in fleet.unavailable(detail=True).items():  # the operator's console
                        click.echo(f"note: tier {name} is not available: {why}", err=True)
                    click.echo(banner(self.keys, host=s.host, port=s.port, data_dir=s.data_dir))
                    return
                waiting = ", ".join(sorted(name for name, st in fleet.status().items() if not st["ready"] and any(
                    r["status"] not in ("unavailable", "preparing") for r in st["replicas"])))
                if waiting and waiting != last:
                    click.echo(f"waiting for tiers to load: {waiting}", err=True)
                    last = waiting


def worker_main() -> None:
    """One worker: the app its parent configured, on its own SO_REUSEPORT socket, until SIGTERM."""
    import uvicorn

    from gateway import http_limits
    from gateway.app import create_app

    settings = Settings.model_validate_json(os.environ.pop(WORKER_SETTINGS_ENV))
    index = os.environ.get(WORKER_INDEX_ENV, "?")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s worker {index} %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    exit_when_orphaned()
    sock = worker_socket(settings.host, settings.port)
    app = create_app(settings, check_redis=False)  # the parent checked its Redis once for every worker
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                           backlog=LISTEN_BACKLOG, http=http_limits.for_settings(settings)))
    server.run(sockets=[sock])
    sys.exit(0 if server.started else STARTUP_FAILURE)


if __name__ == "__main__":
    worker_main()
