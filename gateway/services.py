"""What the app's handlers use, built once at start-up by the app factory and provided to them by
dependency injection (gateway/app.py's `dependencies`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.ladder.controller import LadderController
from gateway.metrics import GatewayMetrics
from gateway.pipeline.cache_lookup import CacheStage
from gateway.pipeline.handle import Pipeline
from gateway.redis_eviction_watch import RedisEvictionWatch
from gateway.report_gate import ReportGate
from gateway.rollout.service import RolloutService
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from quotas.backends.base import QuotaBackend
from quotas.dispatch import TierQueue
from quotas.ledger import Ledger
from quotas.plans import PlanBook
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet


@dataclass(kw_only=True)
class Services:
    settings: Settings
    catalogue: TierCatalogue
    plans: PlanBook
    store: TenantStore
    ledger: Ledger
    client: TierClient
    fleet: Fleet
    metrics: GatewayMetrics
    pipeline: Pipeline
    queues: dict[str, TierQueue]
    quota_backend: QuotaBackend
    ladder: LadderController
    cache: CacheStage
    rollouts: RolloutService
    redis_eviction: RedisEvictionWatch | None = None  # with TIERGATE_REDIS_URL: its policy, read again
    reports: ReportGate = field(default_factory=ReportGate)  # usage reports' own threads (gateway/report_gate.py)
