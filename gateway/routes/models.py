"""GET /v1/models: the tiers a key may use, `auto`, the embedding model, whether each is ready, and what each
can do (`capabilities`: the endpoints that serve it, and `tools` where chat answers tool calls).

GET /v1/models/{model}: one entry of that list, as the OpenAI SDKs' `models.retrieve` reads it; a model the key does
not see is OpenAI's 404 `model_not_found`, in the same words for a name that is no tier and for a tier the key's plan
leaves out (neither tells a tenant the names of tiers its plan does not offer)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.di import NamedDependency, Provide
from litestar.openapi import ResponseSpec
from litestar.params import FromPath

from gateway.auth import provide_principal
from gateway.errors import NotFound
from gateway.query_params import refuse_query
from gateway.routes.openapi import BEARER, errors
from gateway.tenant_plans import tenant_plan
from gateway.tenants.records import Principal
from quotas.plans import PlanBook
from tiers.fleet import Fleet
from tiers.routing import AUTO
from wire.embeddings import EMBEDDING_DIM
from wire.response_models import Model, ModelList

# the endpoints a chat tier answers on through this gateway
TIER_CAPABILITIES = ["chat.completions", "completions"]
EMBEDDING_CAPABILITIES = ["embeddings"]
TOOLS = "tools"  # the tier answers `tools` (tiers/catalogue.py's TierSpec.tools)


@get("/v1/models", dependencies={"principal": Provide(provide_principal)}, tags=["OpenAI"], summary="List models",
     security=BEARER, responses={200: ResponseSpec(ModelList, generate_examples=False, description="The models"),
                                 **errors(401, 500, 503)})
async def list_models(request: Request[Any, Any, Any], principal: NamedDependency[Principal],
                      fleet: NamedDependency[Fleet], plans: NamedDependency[PlanBook]) -> dict[str, Any]:
    """The tiers the key's plan allows, `auto`, and the embedding model; an admin key sees every tier."""
    refuse_query(request)
    return {"object": "list", "data": _entries(principal, fleet, plans)}


@get("/v1/models/{model_id:str}", dependencies={"principal": Provide(provide_principal)}, tags=["OpenAI"],
     summary="Retrieve a model", security=BEARER,
     responses={200: ResponseSpec(Model, generate_examples=False, description="The model, as /v1/models lists it"),
                **errors(401, 404, 500, 503)})
async def retrieve_model(request: Request[Any, Any, Any], model_id: FromPath[str],
                         principal: NamedDependency[Principal], fleet: NamedDependency[Fleet],
                         plans: NamedDependency[PlanBook]) -> dict[str, Any]:
    """One model the key sees, as /v1/models lists it."""
    refuse_query(request)
    for entry in _entries(principal, fleet, plans):
        if entry["id"] == model_id:
            return entry
    raise NotFound(f"the model {model_id[:256]!r} does not exist or you do not have access to it", param="model",
                   code="model_not_found")


def _entries(principal: Principal, fleet: Fleet, plans: PlanBook) -> list[dict[str, Any]]:
    """The models `principal` sees, as /v1/models lists them.

    `unavailable_reason` is in words any key may read ("starting", "the tier's backend could not be reached",
    "circuit breaker open on every healthy replica"...), never a replica's own reason, which names the upstream's URL
    and the exception; an operator reads those on the admin /health and /admin/ops."""
    unavailable = fleet.unavailable(detail=False)
    if principal.tenant is not None:
        plan = tenant_plan(plans, principal)
        names, default = plan.allowed_tiers, plan.default_tier
    else:
        names, default = list(fleet.catalogue.tiers), None
    tools = [TOOLS] if any(fleet.catalogue.tiers[name].tools for name in names) else []
    data = [{"id": AUTO, "object": "model", "created": 0, "owned_by": "tiergate",
             "description": f"routed by Tiergate (now: {default or 'the plan default'})", "available": True,
             "capabilities": TIER_CAPABILITIES + tools}]
    for name in names:
        spec = fleet.catalogue.tiers[name]
        data.append({
            "id": name, "object": "model", "created": 0, "owned_by": "tiergate",
            "description": spec.description, "available": name not in unavailable,
            "unavailable_reason": unavailable.get(name), "context_length": spec.context_limit,
            "pricing": {"input_per_1k_usd": str(spec.price_per_1k_input),
                        "output_per_1k_usd": str(spec.price_per_1k_output)},
            "capabilities": TIER_CAPABILITIES + ([TOOLS] if spec.tools else []),
        })
    if (embeddings := fleet.catalogue.embeddings).enabled:
        data.append({"id": embeddings.model, "object": "model", "created": 0, "owned_by": "tiergate",
                     "description": embeddings.description, "available": True, "dimensions": EMBEDDING_DIM,
                     "pricing": {"input_per_1k_usd": str(embeddings.price_per_1k_input)},
                     "capabilities": EMBEDDING_CAPABILITIES})
    return data
