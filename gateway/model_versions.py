"""Retiring the cache's answers of model versions no tier serves any more.

A cache scope carries the model version of the tier that answers (`Fleet.model_version`: its engines' fingerprint,
or what a remote tier declares, and the version's name for a tier with versions), so once a tier stops serving a
version its entries can never be served again; left alone they hold the store's room until their TTL. A version
stops being served when a rollout moves a tier (a promotion to `full`, a rollback: `RolloutService.serving`), when
a tier's engines come back with other weights (their /health fingerprint, read by the supervisor or, in a worker
of `tiergate serve --workers N`, by its probes of the engines file's replicas), and when the gateway restarts with
another tiers file.

`ModelVersions.check`, run every `EVERY_S` off the request path, compares the versions served now with those of its
last round: each one gone is retired (`SemanticCache.retire_model_version`: its entries deleted, its late writes
dropped), each new one is served (a version rolled back to keeps its new answers). Its first round with every
tier's version known (each local tier's engines have reported their fingerprint: before, a tier reads as what it
declares) also retires whatever else the store holds: versions of the gateway before a restart. A replica whose
engine is down keeps its last fingerprint, so a restart of the same weights retires nothing. That sweep runs only on
a store this host's gateway owns (`sweep_store`: the SQLite file its workers share, of one tiers file): a Redis
store is a fleet's, whose replicas may serve other versions for a while (a rolling deploy, hosts with other
weights), and a sweep deleted their answers, then kept deleting each one they wrote (the version stayed retired
here). There, what was served before a restart ends at its TTL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache import CacheStoreError, SemanticCache
from gateway.rollout.service import RolloutService
from tiers.catalogue import TierCatalogue
from tiers.fleet import Fleet

log = logging.getLogger("tiergate.cache")
EVERY_S = 1.0  # how often the served versions are compared (a few dictionary reads per tier)

Served = Callable[[], tuple[set[str], bool]]  # (the model versions served now, whether each is known)


def served_versions(catalogue: TierCatalogue, fleet: Fleet, rollouts: RolloutService) -> Served:
    """What every tier serves now: each version a rollout may send a request to, as its cache scopes name it."""
    def served() -> tuple[set[str], bool]:
        specs = [spec for tier in catalogue.tiers.values() for spec in rollouts.serving(tier)]
        return {fleet.model_version(spec) for spec in specs}, all(fleet.model_version_known(s) for s in specs)

    return served


class ModelVersions:
    """Follows the served model versions and retires, in the cache, each one no tier serves any more."""

    def __init__(self, cache: SemanticCache, served: Served, *, sweep_store: bool = True) -> None:
        self.cache = cache
        self.served = served
        self.sweep_store = sweep_store  # whether the first round retires what else the store holds (the docstring)
        self._last: set[str] = set()  # served at the last round
        self._failed: set[str] = set()  # retirements the store failed: tried again next round, unless served again
        self._swept = False  # the store's versions of before this process were looked at

    def check(self) -> list[str]:
        """One round (blocking: run it in a worker thread). Returns the versions retired. A store fault is raised
        after the round (the caller logs it once); what it left undone is tried again next round."""
        now, known = self.served()
        # a failed retirement left its version retired in the cache (its late writes dropped): served again, it is
        # served here too, or its answers were dropped for as long as it was served
        for version in (now - self._last) | (now & self._failed):
            self.cache.serve_model_version(version)
        gone, self._last, self._failed = (self._last | self._failed) - now, set(now), set()
        fault: CacheStoreError | None = None
        if known and self.sweep_store and not self._swept:
            try:
                gone |= self.cache.model_versions() - now
                self._swept = True
            except CacheStoreError as exc:
                fault = exc
        retired = []
        for version in sorted(gone):
            try:
                deleted = self.cache.retire_model_version(version)
            except CacheStoreError as exc:
                self._failed.add(version)  # gone again next round, unless served again by then
                fault = exc
                continue
            retired.append(version)
            # INFO when it deleted something (a local tier's declared version, before its fingerprint, never has)
            log.log(logging.INFO if deleted else logging.DEBUG, "model version %s is no longer served: deleted its "
                    "%d cached answers", version, deleted)
        if fault is not None:
            raise fault
        return retired
