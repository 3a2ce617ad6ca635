"""What every stage may read about the request and none may change: who asks, under which plan, when."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.tenants.records import Principal
from quotas.plans import Plan


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    principal: Principal  # a tenant's key (admin keys do not call models)
    plan: Plan
    headers: Mapping[str, str]  # the client's request headers, lower-case names
    arrived: float  # time.time() at arrival: the ledger's timestamp and the response's `created`
    t0: float  # time.perf_counter() at arrival: latencies are measured from it

    @property
    def tenant(self) -> str:
        assert self.principal.tenant is not None
        return self.principal.tenant.name

    @property
    def key_id(self) -> str:
        return self.principal.key.key_id
