"""The running fleet: every tier's replicas, their health, and which one takes the next request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiers.breaker import State
from tiers.catalogue import TierCatalogue, TierSpec
from tiers.client import TierClient
from tiers.errors import NoTierAvailable, TierError
from tiers.replica import Replica
from tiers.replica_choice import AffinityMap, choose_replica
from tiers.supervisor import EngineProcess

log = logging.getLogger("tiergate.fleet")
REMOTE_HEALTH_EVERY_S = 5.0


class Fleet:
    def __init__(self, catalogue: TierCatalogue, client: TierClient, *, models_dir: Path, log_dir: Path,
                 start_timeout_s: float = 600.0) -> None:
        self.catalogue = catalogue
        self.client = client
        self.replicas: dict[str, list[Replica]] = {}
        self._engines: list[EngineProcess] = []
        self._tasks: list[asyncio.Task[None]] = []
        for spec in catalogue.tiers.values():
            if spec.backend == "local":
                reps = [Replica(spec.name, i) for i in range(spec.replicas)]
                self._engines += [EngineProcess(spec, r, models_dir=models_dir, log_dir=log_dir, client=client,
                                                start_timeout_s=start_timeout_s) for r in reps]
            else:
                reps = [Replica(spec.name, i, url=u) for i, u in enumerate(spec.urls)]
            self.replicas[spec.name] = reps
            for rep in reps:
                rep.breaker.on_change = _log_breaker(rep)
        self.affinity = AffinityMap()

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(e.run(), name=f"engine-{e.spec.name}-{e.replica.index}")
                       for e in self._engines]
        for spec in self.catalogue.tiers.values():
            if spec.backend == "openai":
                self._tasks.append(asyncio.create_task(self._watch_remote(spec), name=f"remote-{spec.name}"))

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self._engines), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def api_key(self, spec: TierSpec) -> str | None:
        return os.environ.get(spec.api_key_env) if spec.api_key_env else None

    def unavailable(self) -> dict[str, str]:
        """Tiers with no replica that can take a request now (none healthy, or every healthy one's circuit
        breaker open), and why."""
        out = {}
        for name, reps in self.replicas.items():
            if not any(r.healthy for r in reps):
                out[name] = "; ".join(sorted({r.reason for r in reps if r.reason})) or "no healthy replica"
            elif not any(r.can_take for r in reps):
                out[name] = "circuit breaker open on every healthy replica"
        return out

    def model_version(self, tier: TierSpec) -> str:
        """What the tier's answers depend on: its engines' fingerprint, or its declared model for remote ones."""
        versions = sorted({r.model_version for r in self.replicas[tier.name] if r.model_version})
        if versions:
            return "|".join(versions)
        return f"{tier.backend}:{tier.model}:{tier.quantize or 'none'}:{tier.dtype}"

    def max_kv_utilisation(self) -> float:
        """The fullest engine KV cache among healthy local replicas (0 to 1), as their /health reports it."""
        return max((r.stats.get("kv_utilisation", 0.0) for reps in self.replicas.values() for r in reps
                    if r.healthy), default=0.0)

    def num_tiers_down(self) -> int:
        """Tiers with no healthy replica and one failing (not first starting, not waiting for its model)."""
        return sum(1 for reps in self.replicas.values()
                   if not any(r.healthy for r in reps) and any(r.is_down for r in reps))

    def pick(self, tier: str, exclude: set[int] | None = None, affinity: str | None = None) -> tuple[Replica, str]:
        """The replica for a request, and why: its conversation's replica (`affinity` key) when that one can
        take it, else the least predicted wait; `exclude`d indexes were tried already."""
        preferred = self.affinity.get(affinity, tier) if affinity is not None else None
        replica, why = choose_replica(self.replicas[tier], exclude=exclude, preferred=preferred)
        if replica is None:
            raise NoTierAvailable(f"tier {tier!r} has no replica that can take a request: {why}")
        replica.breaker.begin()
        return replica, why

    def served(self, affinity: str | None, replica: Replica) -> None:
        """The replica answered this conversation: its next turn should go there too."""
        if affinity is not None:
            self.affinity.remember(affinity, replica.tier, replica.index)

    def status(self) -> dict[str, Any]:
        out = {}
        for name, reps in self.replicas.items():
            ready = sum(r.healthy for r in reps)
            out[name] = {"ready": ready > 0, "replicas_ready": ready, "replicas": [r.public() for r in reps]}
        return out

    async def _watch_remote(self, spec: TierSpec) -> None:
        key = self.api_key(spec)
        while True:
            for rep in self.replicas[spec.name]:
                try:
                    await self.client.get_json(f"{(rep.url or '').rstrip('/')}/v1/models", timeout_s=3.0,
                                               api_key=key)
                    if not rep.healthy:
                        log.info("remote tier %s replica %d is up at %s", spec.name, rep.index, rep.url)
                    rep.mark("ready", "")
                except TierError as exc:
                    if rep.healthy or rep.status == "starting":
                        log.warning("remote tier %s replica %d is down: %s", spec.name, rep.index, exc)
                    rep.mark("down", f"health check failed: {exc}")
            await asyncio.sleep(REMOTE_HEALTH_EVERY_S)


def _log_breaker(rep: Replica) -> Callable[[State, State, str], None]:
    def on_change(old: State, new: State, why: str) -> None:
        level = logging.WARNING if new == "open" else logging.INFO
        log.log(level, "tier %s replica %d: circuit %s -> %s (%s)", rep.tier, rep.index, old, new, why)
    return on_change
