"""What the app's handlers use, built once at start-up by the app factory."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.cache_service import CacheService
from gateway.chat_service import ChatService
from gateway.ladder.controller import LadderController
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.tenants.store import TenantStore
from quotas.backends.base import QuotaBackend
from quotas.ledger import Ledger
from quotas.plans import PlanBook
from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet


@dataclass
class Services:
    settings: Settings
    catalogue: TierCatalogue
    plans: PlanBook
    store: TenantStore
    ledger: Ledger
    client: TierClient
    fleet: Fleet
    metrics: GatewayMetrics
    chat: ChatService
    quota_backend: QuotaBackend
    ladder: LadderController
    cache: CacheService
