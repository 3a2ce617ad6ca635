"""POST /v1/embeddings: OpenAI's embeddings API, served by the gateway's MiniLM (gateway/embeddings_service.py)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, post
from litestar.di import NamedDependency, Provide
from litestar.enums import MediaType
from litestar.openapi import ResponseSpec

from gateway.auth import provide_tenant
from gateway.embeddings_service import EmbeddingsService
from gateway.embeddings_settle import TIER
from gateway.middleware import hold_until_sent
from gateway.pipeline.context import RequestContext
from gateway.query_params import refuse_query
from gateway.request_headers import request_headers
from gateway.routes.openapi import BEARER, body, errors
from gateway.tenant_plans import tenant_plan
from gateway.tenants.records import Principal
from quotas.plans import PlanBook
from wire.client_watch import CLIENT_CLOSED, ClientLeft, ClientWatch
from wire.embeddings import EmbeddingRequest
from wire.response_models import EmbeddingList


@post("/v1/embeddings", status_code=200, tags=["OpenAI"], summary="Create embeddings",
      dependencies={"principal": Provide(provide_tenant), "openapi_body": body(EmbeddingRequest)}, security=BEARER,
      responses={200: ResponseSpec(EmbeddingList, generate_examples=False, description="One vector per input"),
                 **errors(400, 401, 403, 404, 409, 413, 422, 429, 500, 503)})
async def create_embeddings(request: Request[Any, Any, Any], principal: NamedDependency[Principal],
                            embeddings: NamedDependency[EmbeddingsService],
                            plans: NamedDependency[PlanBook]) -> Response[Any]:
    """OpenAI's embeddings, by the gateway's all-MiniLM-L6-v2 (normalized, 384 dimensions), billed per token."""
    refuse_query(request)
    ctx = RequestContext(request.state.request_id, principal, tenant_plan(plans, principal),
                         request_headers(request), time.time(), request.state.t0)
    request.state.tier = TIER
    entry = embeddings.admit(ctx)  # the tenant's gate before its body is read (gateway/pipeline/gate.py `Pass`)
    hold_until_sent(request.scope, entry)  # its place held until the answer's body is handed over (middleware.py)
    try:
        raw = await request.body()
        watch = ClientWatch(request)  # a client that leaves stops its work (embeddings_service.py: what it is billed)
        try:
            answer, headers = await watch.run(embeddings.embed(ctx, raw, entry))
        except ClientLeft:
            return Response(None, status_code=CLIENT_CLOSED)
        finally:
            watch.close()
    finally:
        if not entry.taken:  # `embed` never started: its place is the route's to give back
            entry.leave()
    return Response(answer, media_type=MediaType.JSON, headers=headers)  # its JSON, built off the event loop
