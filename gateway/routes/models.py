"""GET /v1/models: the tiers a key may use, `auto`, and whether each is ready."""

from __future__ import annotations

from typing import Any

from litestar import get
from litestar.di import NamedDependency, Provide

from gateway.auth import provide_principal
from gateway.tenants.store import Principal
from quotas.plans import PlanBook
from tiers.fleet import Fleet
from tiers.routing import AUTO


@get("/v1/models", dependencies={"principal": Provide(provide_principal)})
async def list_models(principal: NamedDependency[Principal], fleet: NamedDependency[Fleet],
                      plans: NamedDependency[PlanBook]) -> dict[str, Any]:
    unavailable = fleet.unavailable()
    if principal.tenant is not None:
        plan = plans.plans[principal.tenant.plan]
        names, default = plan.allowed_tiers, plan.default_tier
    else:
        names, default = list(fleet.catalogue.tiers), None
    data = [{"id": AUTO, "object": "model", "created": 0, "owned_by": "tiergate",
             "description": f"routed by Tiergate (now: {default or 'the plan default'})", "available": True}]
    for name in names:
        spec = fleet.catalogue.tiers[name]
        data.append({
            "id": name, "object": "model", "created": 0, "owned_by": "tiergate",
            "description": spec.description, "available": name not in unavailable,
            "unavailable_reason": unavailable.get(name), "context_length": spec.context_limit,
            "pricing": {"input_per_1k_usd": str(spec.price_per_1k_input),
                        "output_per_1k_usd": str(spec.price_per_1k_output)},
        })
    return {"object": "list", "data": data}
