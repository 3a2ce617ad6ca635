"""/metrics with several gateway workers (`tiergate serve --workers N`): one answer for the whole gateway.

Prometheus scrapes the port, and each scrape reaches whichever worker the kernel picks; per-worker counters
would seem to reset from one scrape to the next. So the workers run prometheus_client's multiprocess mode: the
parent sets PROMETHEUS_MULTIPROC_DIR (a fresh `<data dir>/metrics` per start) before any worker imports the
library, every counter and histogram is kept in a small memory-mapped file per process, and any worker's /metrics
sums them all (a worker that exited keeps counting in the sums, as a counter must). `tiergate_redis_up` is
one series per worker (a `pid` label). What the gateway reads from its own state at scrape time (tier and
replica health, circuit breakers, engine stats, dispatch queues, the ladder's level) is the answering worker's
view: engines and the ladder are the same for every worker; breakers and queues are that worker's own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.metrics import GatewayMetrics
from tiers.fleet import Fleet

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it once, at import


def fresh_metrics_dir(path: Path) -> Path:
    """An empty directory for this start's metric files: what an earlier start counted is not counted again."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def forget_process(path: Path, pid: int) -> None:
    """A worker exited: drop its gauges (its counters and histograms stay in the sums)."""
    for f in path.glob(f"gauge_*_{pid}.db"):
        f.unlink(missing_ok=True)


def gateway_metrics(fleet: Fleet | None) -> GatewayMetrics:
    """The metrics of this process: summed over the workers when their parent set METRICS_DIR_ENV."""
    directory = os.environ.get(METRICS_DIR_ENV)
    return WorkerMetrics(fleet, Path(directory)) if directory else GatewayMetrics(fleet)


class WorkerMetrics(GatewayMetrics):
    def __init__(self, fleet: Fleet | None, directory: Path) -> None:
        super().__init__(fleet)
        self.directory = directory

    def render(self) -> bytes:
        shared = CollectorRegistry()
        MultiProcessCollector(shared, path=str(self.directory))
        summed = list(shared.collect())
        names = {family.name for family in summed}
        # what no process writes to the files: the collectors that read this worker's state at scrape time
        own = [family for family in self.registry.collect() if family.name not in names]
        return generate_latest(_Families(summed + own))  # type: ignore[arg-type]


class _Families:
    def __init__(self, families: Iterable[Any]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Any]:
        return iter(self.families)
