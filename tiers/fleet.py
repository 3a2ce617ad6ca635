"""The running fleet: every tier's replicas, their health, and which one takes the next request.

Co-located engines share one core budget, split among the local replicas into core sets (tiers/core_plan.py);
tiers whose engines share cores form a hardware group, and the router sheds an overloaded tier's requests only to a
tier outside its group.

With `tiergate serve --workers N` the gateway keeps N cores by default (the workers run there), and only the
parent process supervises engines: it publishes them (tiers/engines_file.py) and each worker's Fleet follows
that file (`engines_file`), planning the same core shares from the budget the parent published.

A tier with `versions` has replicas for each version; the serving version's are `replicas[tier]`, another's are
named `tier@version`. Every version of a local tier runs engines of its own, all started and kept warm (a
rollback never waits for a model to load), and all counted in the core split like any other replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from quotas.fault_log import FaultLog
from tiers.breaker import State
from tiers.catalogue import TierCatalogue, TierSpec
from tiers.client import TierClient
from tiers.core_plan import SHARED_HOST as SHARED_HOST  # re-exported: tests read fleet.SHARED_HOST
from tiers.core_plan import hardware_groups, host_core_budget, plan_cores
from tiers.engines_file import EngineFollower, engines_document, read_published
from tiers.errors import NoTierAvailable, TierError, UpstreamTimedOut
from tiers.replica import Replica
from tiers.replica_choice import AffinityMap, choose_replica
from tiers.supervisor import CoreShare, EngineProcess

log = logging.getLogger("tiergate.fleet")
REMOTE_HEALTH_EVERY_S = 5.0
BUSY_GRACE_S = 10.0  # an unanswered health check of a busy replica is forgiven this long after it last sent us a
# chunk or its requests in flight began (`_lately`)
UNANSWERED_TO_DOWN = 2  # unanswered health checks in a row that take a replica out (refused: the first)


class Fleet:
    def __init__(self, catalogue: TierCatalogue, client: TierClient, *, models_dir: Path, log_dir: Path,
                 start_timeout_s: float = 600.0, core_budget: Sequence[int] | bool | None = True,
                 engines_file: Path | None = None, max_body_bytes: int | None = None) -> None:
        """`max_body_bytes`: the gateway's body limit, which its local engines' follow (None: their default).
        `core_budget`: the CPUs local engines split (True: `host_core_budget()` from this process's
        affinity and the environment; None: no budget, engines unpinned). `engines_file`: another process
        supervises the local engines and publishes them there; this fleet follows them and starts none."""
        self.catalogue = catalogue
        self.client = client
        self.replicas: dict[str, list[Replica]] = {}  # the serving version's, for a tier with versions
        self.version_replicas: dict[tuple[str, str], list[Replica]] = {}  # (tier, other version) -> its replicas
        self._engines: list[EngineProcess] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._follower: EngineFollower | None = None
        if engines_file is not None:
            published = read_published(engines_file)
            if published is None:
                raise RuntimeError(f"{engines_file}: no local engines published there (a worker of "
                                   f"`tiergate serve --workers N` starts after its parent has written it)")
            core_budget = published.core_budget
        budget = host_core_budget() if core_budget is True else core_budget
        self.core_budget = None if budget is None else list(budget)
        local: list[tuple[TierSpec, Replica]] = []  # every local engine: its version's spec and its replica
        for spec in catalogue.tiers.values():
            for variant in sorted(spec.variants.values() or [spec], key=lambda v: v is not spec):  # serving first
                label = spec.name if variant is spec else f"{spec.name}@{variant.version_name}"
                if spec.backend == "local":
                    reps = [Replica(label, i) for i in range(variant.replicas)]
                    local += [(variant, r) for r in reps]
                else:
                    reps = [Replica(label, i, url=u) for i, u in enumerate(variant.urls)]
                if variant is spec:
                    self.replicas[spec.name] = reps
                else:
                    self.version_replicas[(spec.name, variant.version_name or "")] = reps
                for rep in reps:
                    rep.breaker.on_change = _log_breaker(rep)
        self._local_tier = {rep.tier: variant.name for variant, rep in local}  # replica label -> its tier
        # (label, index) -> its share: every version's engines count, so versions never oversubscribe the cores
        self.core_shares = self._plan(local, budget, quiet=engines_file is not None)
        if engines_file is None:
            self._engines = [EngineProcess(variant, rep, models_dir=models_dir, log_dir=log_dir, client=client,
                                           start_timeout_s=start_timeout_s, max_body_bytes=max_body_bytes,
                                           cores=self.core_shares.get((rep.tier, rep.index))) for variant, rep in local]
        else:
            self._follower = EngineFollower(engines_file, [rep for _, rep in local], client)
        self.affinity = AffinityMap()
        self._no_replica: dict[str, FaultLog] = {}  # per label: a tier outage logged once, not per request
        self.hardware_groups = hardware_groups(self.catalogue.tiers.values(), self.core_shares, self._local_tier,
                                               budgeted=budget is not None)

    def _plan(self, local: Sequence[tuple[TierSpec, Replica]], budget: Sequence[int] | None, *,
              quiet: bool = False) -> dict[tuple[str, int], CoreShare]:
        """Split the budget among the local replicas (every version's), dearest tier first, each tier's serving
        version before its others, and say how in the log (unless `quiet`: the process that supervises the engines
        says it)."""
        if budget is None:
            if not quiet:
                log.info("core budget off: local engines run unpinned, with torch's own thread counts")
            return {}
        rank = {spec.name: i for i, spec in enumerate(reversed(self.catalogue.by_price()))}
        ordered = sorted(local, key=lambda vr: rank[vr[0].name])  # stable: serving version, then declared order
        shares = plan_cores([(f"{rep.tier}/{rep.index}", variant.cores or 1.0) for variant, rep in ordered], budget)
        plan = {(rep.tier, rep.index): share for (_, rep), share in zip(ordered, shares, strict=True)}
        for (label, i), share in plan.items() if not quiet else ():
            level = logging.WARNING if share.shared_with else logging.INFO
            also = f", shared with {', '.join(share.shared_with)} (more replicas than cores)" \
                if share.shared_with else ""
            log.log(level, "tier %s replica %d: cores %s, %d threads%s", label, i,
                    ",".join(map(str, share.cores)), share.threads, also)
        return plan

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(e.run(), name=f"engine-{e.replica.tier}-{e.replica.index}")
                       for e in self._engines]
        if self._follower is not None:
            self._tasks.append(asyncio.create_task(self._follower.run(), name="engines-followed"))
        remote = [(spec.name if variant is spec else f"{spec.name}@{variant.version_name}", variant)
                  for spec in self.catalogue.tiers.values() if spec.backend == "openai"
                  for variant in spec.variants.values() or [spec]]
        # one health check of every remote tier before the app serves (a worker listens once started): a worker
        # that has just (re)started would otherwise answer 503 for a tier that is up until its first check
        await asyncio.gather(*(self._check_remote(variant) for _, variant in remote))
        for label, variant in remote:
            self._tasks.append(asyncio.create_task(self._watch_remote(variant), name=f"remote-{label}"))

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self._engines), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def published(self) -> dict[str, Any]:
        """What the workers of `tiergate serve --workers N` need of the engines this fleet supervises."""
        return engines_document(self.core_budget, self._engines)

    def api_key(self, spec: TierSpec) -> str | None:
        return os.environ.get(spec.api_key_env) if spec.api_key_env else None

    def unavailable(self, *, detail: bool = False) -> dict[str, str]:
        """Tiers with no replica that can take a request now (none healthy, or every healthy one's circuit
        breaker open), and why: by default in words a tenant may read (routing reasons, /v1/models, error
        messages), never a replica's own reason, which names its URL and the exception; `detail`: those reasons,
        for operators only (the admin /health, logs)."""
        out = {}
        for name, reps in self.replicas.items():
            if not any(r.healthy for r in reps):
                reasons = {r.reason for r in reps if r.reason} if detail else {public_reason(r) for r in reps}
                out[name] = "; ".join(sorted(reasons)) or "no healthy replica"
            elif not any(r.can_take for r in reps):
                out[name] = "circuit breaker open on every healthy replica"
        return out

    def replicas_of(self, tier: TierSpec) -> list[Replica]:
        """The replicas of the tier's version that `tier` is (the serving one's for a tier without versions)."""
        return self.version_replicas.get((tier.name, tier.version_name or ""), self.replicas[tier.name])

    def model_version(self, tier: TierSpec) -> str:
        """What the tier's answers depend on: its engines' fingerprint, or what it declares (`declared_version`) for
        remote ones; for a tier with versions, also the version's name, so no two versions share a cache scope."""
        versions = sorted({r.model_version for r in self.replicas_of(tier) if r.model_version})
        found = "|".join(versions) if versions else declared_version(tier)
        return found if tier.version_name is None else f"{found}@{tier.version_name}"

    def model_version_known(self, tier: TierSpec) -> bool:
        """Whether `model_version` says what the tier's engines run: always for a remote tier (what it declares is all
        there is); for a local one once a replica has reported its fingerprint (until then it says what the tier
        declares, which no answer of its engines was stored under)."""
        return tier.backend != "local" or any(r.model_version for r in self.replicas_of(tier))

    def max_kv_utilisation(self) -> float:
        """The fullest engine KV cache among healthy local replicas (0 to 1), as their /health reports it, leaving out
        the blocks of the tenant holding the most where other tenants hold some (`kv_utilisation_others`; an engine
        that does not report it counts whole). The engine's scheduler already takes slots back from a tenant filling
        the cache when another waits; the ladder stepping in (`conserve`: full remapped to mid, outputs capped)
        would degrade every tenant for that one's long prompts."""
        return max((r.stats.get("kv_utilisation_others", r.stats.get("kv_utilisation", 0.0))
                    for r in self._every_replica() if r.healthy), default=0.0)

    def _every_replica(self) -> list[Replica]:
        """Every replica of every version of every tier."""
        return [r for reps in (*self.replicas.values(), *self.version_replicas.values()) for r in reps]

    def num_tiers_down(self) -> int:
        """Tiers with no healthy replica and one failing (not first starting, not waiting for its model)."""
        return sum(1 for reps in self.replicas.values()
                   if not any(r.healthy for r in reps) and any(r.is_down for r in reps))

    def pick(self, tier: str, exclude: set[int] | None = None, affinity: str | None = None,
             version: str | None = None, tenant: str = "") -> tuple[Replica, str]:
        """The replica for a request, and why: its conversation's replica (`affinity` key) when that one can
        take it, else the least predicted wait; `exclude`d indexes were tried already. `version`: one of the
        tier's versions (its own replicas) [default: the serving one]."""
        reps = self.version_replicas.get((tier, version or ""), self.replicas[tier])
        label = reps[0].tier if reps else tier
        preferred = self.affinity.get(affinity, label, tenant) if affinity is not None else None
        replica, why = choose_replica(reps, exclude=exclude, preferred=preferred)
        faults = self._no_replica.get(label)
        if replica is None:  # the message reaches the tenant: the replicas' public reasons, not their own
            named = f"tier {tier!r}" if label == tier else f"tier {tier!r} version {version!r}"
            if faults is None:
                faults = self._no_replica[label] = FaultLog(log, f"{named}: choosing a replica", level=logging.INFO,
                                                            known=(NoTierAvailable,), rounds="requests")
            faults.failed(NoTierAvailable(f"no replica can take a request: {why}"))
            raise NoTierAvailable(f"{named} has no replica that can take a request: "
                                  f"{_why_none_public(reps, exclude or set())}")
        if faults is not None:
            faults.ok()
        replica.breaker.begin()
        return replica, why

    def served(self, affinity: str | None, replica: Replica, tenant: str = "") -> None:
        """The replica answered this conversation of `tenant`'s: its next turn should go there too."""
        if affinity is not None:
            self.affinity.remember(affinity, replica.tier, replica.index, tenant)

    def status(self) -> dict[str, Any]:
        out = {}
        for name, reps in self.replicas.items():
            ready = sum(r.healthy for r in reps)
            replicas = [r.public() | self._cores_of(r) for r in reps]
            out[name] = {"ready": ready > 0, "replicas_ready": ready, "replicas": replicas}
            if name in self.hardware_groups:
                out[name]["hardware_group"] = self.hardware_groups[name]
            spec = self.catalogue.tiers[name]
            if spec.version_name is not None:  # a tier with versions: the serving one above, each one here
                out[name]["serving"] = spec.version_name
                out[name]["versions"] = {v: self._version_status(variant) for v, variant in spec.variants.items()}
        return out

    def _version_status(self, variant: TierSpec) -> dict[str, Any]:
        reps = self.replicas_of(variant)
        ready = sum(r.healthy for r in reps)
        return {"ready": ready > 0, "replicas_ready": ready, "replicas": [r.public() | self._cores_of(r) for r in reps],
                "model": variant.model, "quantize": variant.quantize, "dtype": variant.dtype}

    def _cores_of(self, rep: Replica) -> dict[str, object]:
        share = self.core_shares.get((rep.tier, rep.index))
        if share is not None:
            return share.public()
        if rep.tier in self._local_tier:
            return {"cores": "all (core budget off)"}
        return {}

    async def _watch_remote(self, spec: TierSpec) -> None:
        while True:  # `start` made the first check
            await asyncio.sleep(REMOTE_HEALTH_EVERY_S)
            await self._check_remote(spec)

    async def _check_remote(self, spec: TierSpec) -> None:
        """One health check of each of a remote tier's replicas (3 s at most each).

        A refused or broken check takes a replica out at once. An unanswered one is a strike, and the
        UNANSWERED_TO_DOWN-th in a row takes it out (a replica not yet up, at once): a loaded host that misses one
        3 s answer is not an outage, and a hung one is out within two intervals. No strike is counted while
        requests of ours ran there (when the check began or gave up) and the replica sent one of them a chunk, or
        began to be asked, in the last BUSY_GRACE_S (`_lately`): a server that runs one request at a time may
        answer nothing else until that one ends (llama-cpp-python holds its model's lock for /v1/models too, and
        sends nothing while it reads a long prompt), and a busy server is not a dead one. A hung one sends nothing:
        BUSY_GRACE_S after it was first asked or last heard from, it is counted however much traffic waits there."""
        key = self.api_key(spec)
        for rep in self.replicas_of(spec):
            busy = rep.inflight
            try:
                await self.client.get_json(f"{(rep.url or '').rstrip('/')}/v1/models", timeout_s=3.0, api_key=key)
                if not rep.healthy:
                    log.info("remote tier %s replica %d is up at %s", rep.tier, rep.index, rep.url)
                rep.unanswered = 0
                rep.mark("ready", "")
            except UpstreamTimedOut as exc:
                busy = max(busy, rep.inflight)
                if rep.healthy and busy > 0 and _lately(rep):
                    log.info("remote tier %s replica %d: health check unanswered while %d request(s) ran there "
                             "(%s); left ready", rep.tier, rep.index, busy, exc)
                    rep.unanswered = 0  # busy and heard from (or just asked): not a strike, nor are those before
                    continue
                rep.unanswered += 1
                if rep.healthy and rep.unanswered < UNANSWERED_TO_DOWN:
                    log.info("remote tier %s replica %d: health check unanswered (%d of %d in a row to be taken "
                             "out): %s", rep.tier, rep.index, rep.unanswered, UNANSWERED_TO_DOWN, exc)
                    continue
                self._mark_down(rep, exc)
            except TierError as exc:
                self._mark_down(rep, exc)

    @staticmethod
    def _mark_down(rep: Replica, exc: TierError) -> None:
        if rep.healthy or rep.status == "starting":
            log.warning("remote tier %s replica %d is down: %s", rep.tier, rep.index, exc)
        rep.unanswered = 0
        rep.mark("down", f"health check failed: {exc}")


def _lately(rep: Replica) -> bool:
    """Whether the replica sent one of our requests a chunk, or its requests in flight began, in the last
    BUSY_GRACE_S: busy lately, not hung."""
    latest = max(rep.last_heard or -float("inf"), rep.busy_since or -float("inf"))
    return time.monotonic() - latest <= BUSY_GRACE_S


def declared_version(tier: TierSpec) -> str:
    """A tier's model version before (or without) an engine's fingerprint: the model, precision and, for a remote
    tier, which deployment answers: its name and its set of URLs (order and trailing slashes aside, hashed so that
    no host or credential in a URL lands in cache records). A model name alone says little of what a remote server
    runs: two tiers naming the same model may serve it from other weights or precisions, and must not share a
    cache scope."""
    return _declared_version(tier.backend, tier.model, tier.quantize, tier.dtype, tier.name, tuple(tier.urls))


@lru_cache(maxsize=1024)
def _declared_version(backend: str, model: str, quantize: str | None, dtype: str, name: str,
                      urls: tuple[str, ...]) -> str:
    """`declared_version` from the fields it reads (a cache scope reads it every request: ~3 us, now a lookup)."""
    declared = f"{backend}:{model}:{quantize or 'none'}:{dtype}"
    if backend != "openai":
        return declared
    joined = "\n".join(sorted({url.rstrip("/") for url in urls}))
    return f"{declared}:{name}:{hashlib.sha256(joined.encode()).hexdigest()[:12]}"


def public_reason(rep: Replica) -> str:
    """Why a replica cannot take a request, in words a tenant may read: its state, never its own reason (which
    names its URL, host and port and the exception's details; those are for the admin /health and the logs)."""
    if rep.healthy:
        return f"circuit breaker {rep.breaker.state}"
    if rep.status == "starting":
        return "restarting" if rep.ever_ready else "starting"
    if rep.status == "preparing":
        return "its model is being prepared"
    if rep.status == "unavailable":
        return "its model is not prepared on this gateway"
    if rep.status == "down" and rep.url is not None:
        return "the tier's backend could not be reached"
    return "unhealthy"


def _why_none_public(reps: Sequence[Replica], exclude: set[int]) -> str:
    """`choose_replica`'s reason for finding no replica, with each replica's public reason."""
    left = [r for r in reps if r.index not in exclude]
    if not left:
        return "no replica left to try"
    return "; ".join(f"replica {r.index} {public_reason(r)}" for r in left)


def _log_breaker(rep: Replica) -> Callable[[State, State, str], None]:
    def on_change(old: State, new: State, why: str) -> None:
        level = logging.WARNING if new == "open" else logging.INFO
        log.log(level, "tier %s replica %d: circuit %s -> %s (%s)", rep.tier, rep.index, old, new, why)
    return on_change
