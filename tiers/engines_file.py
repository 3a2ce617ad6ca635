"""Local engines supervised once, used by several gateway processes (`tiergate serve --workers N`).

The parent process supervises the engines (tiers/supervisor.py) and publishes what its workers need in a small
JSON file in the data directory, rewritten atomically (a temporary file renamed over it) whenever it changes:
the host core budget the engines were planned on, and for each local replica its URL, the nonce of its current
start, its status and reason, and its restarts. Each worker follows the file once a second and probes every
replica its parent calls ready, as it probes a remote tier. A probe counts only when the engine reports the
published nonce, so a stale file never routes requests to a stranger that took a freed port; a worker routes to
a replica only after its own probe succeeded. What a probe reads (model version, KV use, token rate) is the
worker's own. Restarting an engine stays the parent's decision; a worker marks a replica down after
HEALTH_FAILURES_TO_KILL failed probes in a row, the count after which the supervisor restarts it.

The file holds the nonces, so it is written owner-only (0600).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assets.atomic_file import replacing
from quotas.fault_log import FaultLog
from tiers.client import TierClient
from tiers.replica import Replica
from tiers.supervisor import HEALTH_EVERY_S, HEALTH_FAILURES_TO_KILL, PROBE_TIMEOUT_S, EngineProcess, probe_engine

ENGINES_FILE = "engines.json"  # in the data directory
log = logging.getLogger("tiergate.supervisor")

PUBLISH_EVERY_S = 0.25  # how often the parent looks for a change to publish


@dataclass(frozen=True)
class PublishedReplica:
    url: str | None
    instance: str  # the nonce of the engine's current start; its /health must report it
    status: str
    reason: str
    restarts: int


@dataclass(frozen=True)
class Published:
    core_budget: list[int] | None  # the CPUs the engines were planned on (None: the budget is off)
    # (tier, replica index) -> its engine; a version other than the serving one's replicas are "tier@version"
    replicas: dict[tuple[str, int], PublishedReplica]


def engines_document(core_budget: Iterable[int] | None, engines: Iterable[EngineProcess]) -> dict[str, Any]:
    """What the parent publishes about the engines it supervises."""
    return {"core_budget": None if core_budget is None else list(core_budget),
            "replicas": [{"tier": e.replica.tier, "index": e.replica.index, "url": e.replica.url,
                          "instance": e.instance, "status": e.replica.status, "reason": e.replica.reason,
                          "restarts": e.replica.restarts} for e in engines]}


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Replace `path` atomically: a reader sees the old document or the new one, never part of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, mode=0o600) as tmp:  # owner-only from the start: it holds the nonces
        tmp.write_text(json.dumps(document, sort_keys=True), encoding="utf-8")


async def publish_engines(path: Path, document: Any, every_s: float = PUBLISH_EVERY_S) -> None:
    """Rewrite `path` whenever `document()` changes (the parent's task, until cancelled). A write that fails (a full
    disk, a read-only data directory) is tried again next round, logged once until one works: it ended the task, and
    the workers then followed no restart of an engine again."""
    last: dict[str, Any] | None = None
    faults = FaultLog(log, f"publishing the local engines to {path} (the workers follow it)")
    while True:
        current = document()
        if current != last:
            try:
                await asyncio.to_thread(write_document, path, current)
            except OSError as exc:
                faults.failed(exc)
            else:
                faults.ok()
                last = current
        await asyncio.sleep(every_s)


def read_published(path: Path) -> Published | None:
    """The published engines, or None when the file is missing or not what a parent writes."""
    try:
        raw = json.loads(path.read_bytes())
        budget = raw["core_budget"]
        replicas = {(r["tier"], int(r["index"])): PublishedReplica(r["url"], str(r["instance"]), str(r["status"]),
                                                                   str(r["reason"]), int(r["restarts"]))
                    for r in raw["replicas"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Published(None if budget is None else [int(c) for c in budget], replicas)


class EngineFollower:
    """A worker's view of the local engines its parent supervises: follows the file, probes what is ready."""

    def __init__(self, path: Path, replicas: Iterable[Replica], client: TierClient, *,
                 probe_timeout_s: float = PROBE_TIMEOUT_S,
                 failures_to_mark_down: int = HEALTH_FAILURES_TO_KILL) -> None:
        self.path = path
        self.replicas = list(replicas)
        self.client = client
        self.probe_timeout_s = probe_timeout_s
        self.failures_to_mark_down = failures_to_mark_down
        self._instances: dict[tuple[str, int], str] = {}
        self._failures: dict[tuple[str, int], int] = {}
        self._verified: set[tuple[str, int]] = set()  # probed successfully since the engine's current start

    async def run(self, every_s: float = HEALTH_EVERY_S) -> None:
        while True:
            await self.step()
            await asyncio.sleep(every_s)

    async def step(self) -> None:
        """Read the file once, mirror what is not ready, probe what is."""
        published = await asyncio.to_thread(read_published, self.path)
        ready = []
        for rep in self.replicas:
            key = (rep.tier, rep.index)
            entry = published.replicas.get(key) if published is not None else None
            if entry is None:
                rep.mark("down", f"its supervisor (the parent process) publishes nothing about it in {self.path}")
                continue
            if (entry.url, entry.instance) != (rep.url, self._instances.get(key)):  # a new start of its engine
                rep.url, self._instances[key] = entry.url, entry.instance
                self._failures[key] = 0
                self._verified.discard(key)
            rep.restarts = entry.restarts
            if entry.status == "ready":
                ready.append(rep)
            else:
                rep.mark(entry.status, entry.reason)
        await asyncio.gather(*(self._check(rep) for rep in ready))

    async def _check(self, rep: Replica) -> None:
        key = (rep.tier, rep.index)
        problem = await probe_engine(self.client, rep, self._instances[key], timeout_s=self.probe_timeout_s)
        if problem is None:
            self._failures[key] = 0
            self._verified.add(key)
            if not rep.healthy or rep.reason:
                rep.mark("ready", "")
            return
        if key not in self._verified:
            rep.mark("starting", f"its supervisor reports it ready; this worker's probe failed: {problem}")
            return
        self._failures[key] += 1
        failures = self._failures[key]
        if failures >= self.failures_to_mark_down:
            rep.mark("down", f"{failures} health probes from this worker failed in a row (last: {problem})")
        else:
            rep.mark("ready", f"health probe failed ({failures} of {self.failures_to_mark_down} before it is "
                              f"marked down): {problem}")


def remove_published(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
