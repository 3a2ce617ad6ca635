"""The Litestar app factory: nothing is loaded at import time; `create_app` wires the services."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response
from litestar.datastructures import State
from litestar.di import Provide

from cache import SemanticCache, default_embedder, open_cache_store
from cache.meaning_check import MeaningCheck, MeaningUnavailable
from cache.meaning_check import model_dir as meaning_model_dir
from gateway.cache_bound_metrics import CacheBoundCollector
from gateway.config_files import ConfigFileError, load_yaml
from gateway.embeddings_service import embeddings_lifespan, provide_embeddings
from gateway.errors import InternalError, PayloadTooLarge, Unavailable, client_error
from gateway.fair_threads import FairThreads
from gateway.ladder.config import load_ladder
from gateway.ladder.controller import LadderController
from gateway.ladder.signals import Signals
from gateway.metrics import GatewayMetrics
from gateway.middleware import request_id_middleware
from gateway.model_versions import EVERY_S as MODEL_VERSIONS_EVERY_S
from gateway.model_versions import ModelVersions, served_versions
from gateway.pipeline.cache_check import CacheChecks
from gateway.pipeline.cache_lookup import CacheStage
from gateway.pipeline.dispatch import DispatchStage
from gateway.pipeline.gate import TenantGate
from gateway.pipeline.handle import Pipeline
from gateway.pipeline.idempotency import IdempotencyStage
from gateway.pipeline.prompt import PromptStage
from gateway.pipeline.refusals import RefusalLog
from gateway.pipeline.reserve import ReserveStage
from gateway.pipeline.route import RouteStage
from gateway.pipeline.settle import Settler
from gateway.pipeline.tier_call import TierCaller
from gateway.redis_eviction import check_redis_eviction
from gateway.redis_eviction_watch import eviction_watch
from gateway.rollout.guards import tier_guards_error
from gateway.rollout.service import RolloutService
from gateway.rollout.shadow import Shadow
from gateway.routes.admin import admin_router
from gateway.routes.chat import chat_completions
from gateway.routes.completions import text_completions
from gateway.routes.dashboard import dashboard
from gateway.routes.degrade import degrade_router
from gateway.routes.embeddings import create_embeddings
from gateway.routes.health import health, metrics_router
from gateway.routes.models import list_models, retrieve_model
from gateway.routes.openapi import WireSchemaPlugin, openapi_config, openapi_document
from gateway.routes.ops import ops_router
from gateway.routes.rollouts import rollouts_router
from gateway.routes.usage import admin_report_router, tenant_report
from gateway.services import Services
from gateway.settings import Settings
from gateway.stores import (
    open_idempotency,
    open_ladder_store,
    open_ledger,
    open_rollout_store,
    open_tenant_store,
)
from gateway.tenant_plans import check_tenant_plans
from gateway.worker_metrics import gateway_metrics
from quotas.backends.base import QuotaBackend
from quotas.backends.failover import FailoverBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.dispatch import TierQueue
from quotas.fault_log import STORE_ERRORS, FaultLog
from quotas.ledger import Ledger
from quotas.plans import PlanBook
from quotas.reaper import run_reaper
from quotas.reservations import QuotaService
from quotas.seed import (
    LedgerFallbackRows,
    ledger_billing,
    ledger_spend_source,
    seed_from_ledger,
    tenant_spend_source,
)
from tiers.catalogue import TierCatalogue, TierSpec
from tiers.client import TierClient
from tiers.fleet import Fleet
from tiers.predictor import PREDICT_THREADS, PredictorSource
from tiers.supervisor import engine_max_num_seqs

log = logging.getLogger("tiergate.gateway")


def load_config(settings: Settings) -> tuple[TierCatalogue, PlanBook]:
    """Parse and cross-check the tiers, plans and ladder files; raises ConfigFileError with file and line."""
    catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    if (bad := tier_guards_error(catalogue)) is not None:
        raise ConfigFileError(settings.tiers_file, None, bad)
    plans = load_yaml(settings.plans_file, PlanBook, context={"tiers": set(catalogue.tiers)})
    load_ladder(settings.ladder_file, catalogue.tiers)
    if checked := [name for name, plan in plans.plans.items() if plan.cache.meaning_check]:
        try:
            meaning_model_dir()
        except MeaningUnavailable as exc:
            raise ConfigFileError(settings.plans_file, None, f"plans {', '.join(checked)} set "
                                  f"cache.meaning_check, but {exc}") from exc
    return catalogue, plans


def build_services(settings: Settings) -> Services:
    catalogue, plans = load_config(settings)
    client = TierClient(connect_timeout_s=settings.upstream_connect_timeout_s,
                        read_timeout_s=settings.upstream_read_timeout_s)
    fleet = Fleet(catalogue, client, models_dir=settings.resolved_models_dir, log_dir=settings.data_dir / "logs",
                  start_timeout_s=settings.engine_start_timeout_s, engines_file=settings.engines_file,
                  max_body_bytes=settings.max_body_bytes)
    metrics_ = gateway_metrics(fleet)  # summed over the workers of `tiergate serve --workers N`
    wait_s = settings.database_start_wait_s  # a fleet database down at start is waited for (gateway/stores.py)
    ledger = open_ledger(settings, wait_s=wait_s)
    store = open_tenant_store(settings, wait_s=wait_s)
    backend = build_quota_backend(settings, ledger, metrics_)
    gate = TenantGate()
    quotas = QuotaService(backend, lease_s=settings.quota_lease_s, on_settled=gate.settled)
    queues = {name: TierQueue(name, tier_capacity(spec, settings), policy=settings.dispatch_policy)
              for name, spec in catalogue.tiers.items()}
    metrics_.queues = queues
    signals = Signals(tiers_down=fleet.num_tiers_down, kv_utilisation=fleet.max_kv_utilisation,
                      redis_down=lambda: isinstance(backend, FailoverBackend) and not backend.up)
    ladder = LadderController(load_ladder(settings.ladder_file, catalogue.tiers),
                              open_ladder_store(settings, wait_s=wait_s), signals,
                              on_change=metrics_.degrade_changed, start_unread=True)  # Redis down: starts at 0
    metrics_.ladder = ladder
    cache = CacheStage(cache=build_cache(settings, plans), store=store, fleet=fleet)
    if cache.cache is not None:
        metrics_.registry.register(CacheBoundCollector(cache.cache))
    rollouts = RolloutService(catalogue, open_rollout_store(settings, wait_s=wait_s), metrics=metrics_)
    metrics_.rollouts = rollouts
    caller = TierCaller(fleet=fleet, client=client, hint_secret=settings.hint_secret.get_secret_value())
    dispatch = DispatchStage(queues=queues, metrics=metrics_, signals=signals)
    pipeline = Pipeline(
        gate=gate, ladder=ladder, cache=cache, dispatch=dispatch,
        route=RouteStage(fleet=fleet, quotas=quotas, dispatch=dispatch,
                         predictor=PredictorSource.for_data_dir(settings.data_dir, threads=prediction_threads()),
                         rollouts=rollouts),
        prompt=PromptStage(models_dir=settings.resolved_models_dir, default_max_tokens=settings.default_max_tokens),
        reserve=ReserveStage(quotas=quotas, gate=gate),
        tier=caller,
        settler=Settler(ledger=ledger, quotas=quotas, dispatch=dispatch, cache=cache, metrics=metrics_,
                        signals=signals, catalogue=catalogue, rollouts=rollouts),
        refusals=RefusalLog(ledger=ledger, metrics=metrics_),
        idempotency=IdempotencyStage(open_idempotency(settings, ledger, wait_s=wait_s)),
        ready=lambda: ledger.not_ready_reason,
        shadow=Shadow(rollouts=rollouts, caller=caller, metrics=metrics_),
        cache_checks=None if cache.cache is None else CacheChecks(cache=cache.cache, caller=caller,
                                                                  registry=metrics_.registry))
    return Services(settings=settings, catalogue=catalogue, plans=plans, store=store, ledger=ledger, client=client,
                    fleet=fleet, metrics=metrics_, pipeline=pipeline, queues=queues, quota_backend=backend,
                    ladder=ladder, cache=cache, rollouts=rollouts,
                    redis_eviction=eviction_watch(settings, metrics_.registry))


# Threads for the cache's lookups (store reads, faiss searches, meaning-check passes), tenants in turn: as many as
# asyncio's default executor, which ran them before, has
LOOKUP_THREADS = min(32, (os.cpu_count() or 1) + 4)


def prediction_threads() -> FairThreads:
    """Threads of their own for `auto`'s difficulty predictions (a MiniLM pass each), tenants in turn."""
    return FairThreads(PREDICT_THREADS, "tiergate-predict")


def build_cache(settings: Settings, plans: PlanBook) -> SemanticCache | None:
    """Entries in Redis (every replica's index follows) when TIERGATE_REDIS_URL is set, else in SQLite. The meaning
    check's model is loaded now when a plan uses it, else on first use."""
    if not settings.cache_enabled:
        return None
    entries = open_cache_store(sqlite_path=settings.data_dir / "cache.sqlite3", redis_url=settings.redis_url,
                               max_entries=settings.cache_max_entries,
                               max_entries_per_tenant=settings.cache_max_entries_per_tenant,
                               max_bytes_per_tenant=settings.cache_max_bytes_per_tenant)
    meaning = MeaningCheck()
    if any(plan.cache.meaning_check for plan in plans.plans.values()):
        try:
            meaning.load()
        except MeaningUnavailable as exc:  # installed (load_config checked) but unusable: a damaged file
            raise ConfigFileError(settings.plans_file, None, f"cache.meaning_check: {exc}") from exc
    return SemanticCache(entries, default_embedder(), embed_batch=settings.cache_embed_max_batch,
                         embed_wait_s=settings.cache_embed_max_wait_ms / 1000, meaning=meaning,
                         threads=FairThreads(LOOKUP_THREADS, "tiergate-cache-lookup"))


def build_quota_backend(settings: Settings, ledger: Ledger, metrics_: GatewayMetrics) -> QuotaBackend:
    """Redis (shared, with the configured failure mode) when TIERGATE_REDIS_URL is set; else memory, seeded
    from the ledger so budgets and windows survive a restart."""
    if settings.redis_url:
        redis = RedisBackend(settings.redis_url, timeout_s=settings.redis_timeout_s,
                             max_connections=settings.redis_max_connections, pool_wait_s=settings.redis_pool_wait_s,
                             settle_retry_s=settings.quota_settle_retry_s,
                             replica_ttl_s=max(30.0, 3 * settings.quota_reap_every_s),
                             tenant_spend=tenant_spend_source(ledger))  # a Redis that lost its data resets no budget
        # in an outage, the fallback starts from the last spend Redis answered and the ledger's totals
        return FailoverBackend(redis, mode=settings.redis_failure_mode, on_state=metrics_.redis_state,
                               ledger_spend=ledger_spend_source(ledger), rows=LedgerFallbackRows(ledger))
    memory = MemoryBackend()
    seed_from_ledger(memory, ledger)
    return memory


def tier_capacity(spec: TierSpec, settings: Settings) -> int:
    """Dispatch slots: per replica, the tier's max_concurrency, else what its engines batch at once (the
    `--max-num-seqs` the supervisor starts them with: what their KV cache holds for a typical request). With
    several gateway workers each has its share, rounded up (`tiergate serve --workers N`)."""
    if spec.backend == "local":
        slots = spec.replicas * (spec.max_concurrency or engine_max_num_seqs(spec, settings.resolved_models_dir))
    else:
        slots = len(spec.urls) * (spec.max_concurrency or settings.remote_max_concurrency)
    return -(-slots // settings.workers)


ROLLOUT_FOLLOW_S = 2.0  # how soon a rollout changed elsewhere (the CLI, another process) takes effect here

# Allocations (less deallocations) between two collections of the youngest generation; Python's default is 700.
GC_GEN0_THRESHOLD = 20_000


def _settle_heap() -> None:
    """After startup: collect once, then move every object alive (models, tokenizers, modules: about half a
    million) out of the collector's sight (`gc.freeze`), and collect the youngest generation less often. With
    Python's defaults every 700 allocations traversed the objects of the requests in flight, promoting them to
    older generations whose collections then walked the whole heap: an exact cache hit cost more CPU at 64
    concurrent requests than at 16 (bench/gateway.py, with and without, side by side: BENCHMARKS.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)


def create_app(settings: Settings | None = None, *, check_redis: bool = True) -> Litestar:
    """The gateway's app; raises before anything starts on a bad config file, a tenant on a missing plan, or a Redis
    that may evict keys (`check_redis`: False where the caller checked it: `tiergate serve`, its workers)."""
    settings = settings or Settings()
    catalogue, plans = load_config(settings)  # fail fast, before anything starts
    if check_redis:
        check_redis_eviction(settings)
    store = open_tenant_store(settings, wait_s=settings.database_start_wait_s)
    try:  # a plan taken out of the plans file while tenants are on it
        check_tenant_plans(store, plans, settings.plans_file)
    finally:
        store.close()
    del catalogue, plans

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        services = build_services(settings)
        app.state.services = services
        services.ledger.start()
        await services.fleet.start()
        if services.cache.cache is not None:  # load the embedder before the first request needs it
            await asyncio.to_thread(services.cache.cache.embedder.encode_one, "warm up")
        # and every tier's tokenizer, which the first request of each would load on the event loop
        await asyncio.to_thread(services.pipeline.prompt.warm, [
            version for spec in services.catalogue.tiers.values() for version in (spec, *spec.variants.values())])
        _settle_heap()
        # the ladder follows shared changes and evaluates its triggers; rollouts changed by the CLI or another
        # process are followed; running rollouts' guards are judged (a rollback writes the store)
        ticker = asyncio.create_task(_every(settings.ladder_tick_s, services.ladder.tick, "degradation ladder tick"))
        follower = asyncio.create_task(_every(ROLLOUT_FOLLOW_S, services.rollouts.follow, "following rollouts"))
        guards = asyncio.create_task(_every(settings.ladder_tick_s, services.rollouts.evaluate,
                                            "evaluating rollout guards"))
        # returns reservations whose lease ran out (a replica died before settling): billed from the ledger; the
        # leases of this replica's requests still running are renewed first
        reaper = asyncio.create_task(run_reaper(services.quota_backend, every_s=settings.quota_reap_every_s,
                                                billed=ledger_billing(services.ledger),
                                                renew=services.pipeline.reserve.quotas.renew_leases))
        # the cache deletes the answers of model versions no tier serves any more (a rollout, new weights); what
        # else the store holds is swept only from this host's own SQLite file, never from a fleet's Redis
        retiring = None if services.cache.cache is None else asyncio.create_task(_every(
            MODEL_VERSIONS_EVERY_S, ModelVersions(services.cache.cache, served_versions(
                services.catalogue, services.fleet, services.rollouts), sweep_store=not settings.redis_url).check,
            "retiring cached model versions"))
        if services.redis_eviction is not None:  # a policy changed while we run is seen (redis_eviction_watch.py)
            await services.redis_eviction.start()
        try:
            yield
        finally:
            ticker.cancel()
            follower.cancel()
            guards.cancel()
            reaper.cancel()
            if retiring is not None:
                retiring.cancel()
            if services.redis_eviction is not None:
                await services.redis_eviction.stop()
            await services.fleet.stop()
            if services.pipeline.shadow is not None:  # shadow calls nobody waits for end with the gateway
                services.pipeline.shadow.cancel()
            if services.pipeline.cache_checks is not None:  # so do the checks of sampled cache hits
                services.pipeline.cache_checks.tasks.cancel()
            await services.client.aclose()
            await services.pipeline.settler.drain()  # settlements reach the quota backend before it closes
            await services.pipeline.reserve.drain()  # so do the reservations of requests that left mid-reserve
            await services.quota_backend.close()
            await services.cache.drain()
            if services.pipeline.idempotency is not None:
                await services.pipeline.idempotency.drain()  # claims of requests that left mid-claim, given up
                await services.pipeline.idempotency.store.close()
            if services.cache.cache is not None:
                services.cache.cache.close()
            services.reports.close()
            if services.pipeline.route.predictor is not None:
                services.pipeline.route.predictor.close()
            services.pipeline.prompt.threads.close()
            services.ledger.close()
            services.store.close()
            services.rollouts.store.close()
            services.ladder.store.close()

    return Litestar(
        route_handlers=[chat_completions, text_completions, create_embeddings, list_models, retrieve_model, health,
                        metrics_router, admin_router, degrade_router, rollouts_router, admin_report_router,
                        tenant_report, ops_router,
                        dashboard, openapi_document],
        lifespan=[lifespan, embeddings_lifespan],
        dependencies={name: Provide(provider, sync_to_thread=False) for name, provider in _PROVIDERS.items()},
        middleware=[request_id_middleware],
        exception_handlers={Exception: _error_response},
        request_max_body_size=settings.max_body_bytes,
        openapi_config=openapi_config(version="0.1.0"),
        plugins=[WireSchemaPlugin()],
    )


def _service(name: str) -> Any:
    def provide(state: State) -> Any:
        return getattr(state.services, name)

    return provide


# what handlers may ask for by name; each is built once per app in `build_services` (embeddings on first use)
_PROVIDERS = {name: _service(name) for name in ("pipeline", "plans", "catalogue", "store", "ledger", "fleet",
                                                 "metrics", "ladder", "cache", "queues", "settings",
                                                 "rollouts", "reports", "redis_eviction")}
_PROVIDERS["embeddings"] = provide_embeddings


async def _every(every_s: float, work: Callable[[], object], what: str) -> None:
    """Run `work` in a worker thread every `every_s`, off the request path; a failure is logged and the next round
    tries again (the ladder keeps its last level, the rollouts read last stay in force). In a store's outage each
    distinct fault is logged once, then one line when a round works again (quotas/fault_log.py)."""
    faults = FaultLog(log, what, known=(*STORE_ERRORS, Unavailable))
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(work)
        except Exception as exc:
            faults.failed(exc)
        else:
            faults.ok()


def _error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Every error a handler raises, in OpenAI's shape (gateway/errors.py's `client_error` maps it)."""
    err = client_error(exc)
    if isinstance(err, InternalError):
        rid = request.scope.get("state", {}).get("request_id")
        log.error("unexpected error in request %s", rid, exc_info=exc)
        err = InternalError(f"internal error (request id {rid}); it has been logged")
    if err.status_code == 413:
        err = PayloadTooLarge(f"the request body is larger than this gateway accepts "
                              f"({request.app.request_max_body_size} bytes)")
    headers = dict(err.headers)
    if err.retry_after is not None:
        headers["retry-after"] = str(max(1, round(err.retry_after)))
    return Response(err.body(), status_code=err.status_code, headers=headers)
