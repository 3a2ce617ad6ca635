"""GET /v1/models: the tiers a key may use, `auto`, and whether each is ready."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.di import NamedDependency, Provide

from gateway.auth import provide_principal
from gateway.tenants.store import Principal
from tiers.routing import AUTO


@get("/v1/models", dependencies={"principal": Provide(provide_principal)})
async def list_models(request: Request[Any, Any, Any], principal: NamedDependency[Principal]) -> dict[str, Any]:
    services = request.app.state.services
    unavailable = services.fleet.unavailable()
    if principal.tenant is not None:
        plan = services.plans.plans[principal.tenant.plan]
        names, default = plan.allowed_tiers, plan.default_tier
    else:
        names, default = list(services.catalogue.tiers), None
    data = [{"id": AUTO, "object": "model", "created": 0, "owned_by": "tiergate",
             "description": f"routed by Tiergate (now: {default or 'the plan default'})", "available": True}]
    for name in names:
        spec = services.catalogue.tiers[name]
        data.append({
            "id": name, "object": "model", "created": 0, "owned_by": "tiergate",
            "description": spec.description, "available": name not in unavailable,
            "unavailable_reason": unavailable.get(name), "context_length": spec.context_limit,
            "pricing": {"input_per_1k_usd": str(spec.price_per_1k_input),
                        "output_per_1k_usd": str(spec.price_per_1k_output)},
        })
    return {"object": "list", "data": data}
