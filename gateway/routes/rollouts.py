"""Rollouts of a tier's model versions (admin key): start a shadow or a canary with its guards, read status and
history, promote, pause, roll back. The CLI (`tiergate rollout …`) does the same on the same store;
gateway/rollout/service.py holds the rules."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from litestar import Request, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import require_admin
from gateway.errors import NotFound
from gateway.ladder.controller import REASON_PATTERN
from gateway.query_params import QUERY_OPT, only_declared_query
from gateway.rollout.guards import Guards
from gateway.rollout.service import RolloutService
from gateway.routes.degrade import HistoryLimit
from gateway.routes.openapi import BEARER, body, errors
from gateway.tenants.rules import NAME_RE
from gateway.tenants.store import TenantStore
from gateway.validation import parse_change_body
from tiers.catalogue import VERSION_NAME

Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]  # of new conversations, 0 to 1
# kept in the audit trail and the log: one line, not only blanks, as a manual degrade's; published, and refused by
# the service by name (param `reason`, code invalid_value or reason_required): a newline went into the log as it was
Reason = Annotated[str, Field(min_length=1, max_length=500, json_schema_extra={"pattern": REASON_PATTERN})]


class StartRollout(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    tier: Annotated[str, Field(min_length=1, max_length=128)]
    version: Annotated[str, Field(min_length=1, max_length=64, pattern=VERSION_NAME)]
    share: Share = 0.0
    # each once (the service refuses a repeat by its place, `tenants.2`; the document says so as uniqueItems)
    tenants: Annotated[list[Annotated[str, Field(pattern=NAME_RE.pattern)]],
                       Field(max_length=100, json_schema_extra={"uniqueItems": True})] = []
    reason: Reason
    shadow: Share | None = None  # a shadow instead of a canary: this share of requests also sent to `version`
    guards: Guards = Guards()  # thresholds that roll it back by themselves (each field defaults; null: off)


class Promote(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    reason: Reason
    share: Share | None = None  # a larger canary share; none: everyone on the candidate (`full`)


class Change(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    reason: Reason


CHANGE_ERRORS = errors(400, 401, 403, 404, 409, 413, 500)


@get("/", responses=errors(400, 401, 403, 500))
async def status(rollouts: NamedDependency[RolloutService]) -> dict[str, Any]:
    """Each tier's latest rollout: stage, share, named tenants, who changed it and why, and each version's requests
    and errors since it started (as this gateway process counted them)."""
    return {"data": rollouts.status()}


@post("/", status_code=201, dependencies={"openapi_body": body(StartRollout)}, responses=CHANGE_ERRORS)
async def start(request: Request[Any, Any, Any], rollouts: NamedDependency[RolloutService],
                store: NamedDependency[TenantStore]) -> dict[str, Any]:
    """A canary: `share` of new conversations, and every named tenant, on `version`; or with `shadow`, a shadow
    (the serving version answers everyone; that share of requests is also sent to `version`, never returned or
    billed). `guards` roll it back by themselves. 409 while one is running; 400 for a `tier`, `version` or named
    tenant that does not exist (`param` `tier`, `version` or `tenants.<index>`): names in the body, not the path;
    400 `duplicate_tenant` for a tenant named twice (`tenants.<index>` of the repeat)."""
    b = parse_change_body(await request.body(), StartRollout)
    await store.admin(store.require_tenants, b.tenants, "tenants")  # before anything changes
    r = await asyncio.to_thread(rollouts.start, b.tier, b.version, share=b.share, tenants=tuple(b.tenants),
                                who=request.state.key_id, reason=b.reason, shadow=b.shadow, guards=b.guards)
    return r.public()


@post("/{tier:str}/promote", status_code=200, dependencies={"openapi_body": body(Promote)}, responses=CHANGE_ERRORS)
async def promote(request: Request[Any, Any, Any], rollouts: NamedDependency[RolloutService],
                  tier: FromPath[str]) -> dict[str, Any]:
    """Everyone on the candidate (`full`), or, with `share`, a larger canary (never smaller; a shadow becomes one)."""
    b = parse_change_body(await request.body(), Promote)
    r = await asyncio.to_thread(rollouts.promote, tier, share=b.share, who=request.state.key_id, reason=b.reason)
    return r.public()


@post("/{tier:str}/pause", status_code=200, dependencies={"openapi_body": body(Change)}, responses=CHANGE_ERRORS)
async def pause(request: Request[Any, Any, Any], rollouts: NamedDependency[RolloutService],
                tier: FromPath[str]) -> dict[str, Any]:
    """Hold the canary: each conversation stays on its version, and the share is not raised until promoted."""
    b = parse_change_body(await request.body(), Change)
    r = await asyncio.to_thread(rollouts.pause, tier, who=request.state.key_id, reason=b.reason)
    return r.public()


@post("/{tier:str}/rollback", status_code=200, dependencies={"openapi_body": body(Change)}, responses=CHANGE_ERRORS)
async def rollback(request: Request[Any, Any, Any], rollouts: NamedDependency[RolloutService],
                   tier: FromPath[str]) -> dict[str, Any]:
    """Everyone back on the version that answered before the rollout started."""
    b = parse_change_body(await request.body(), Change)
    r = await asyncio.to_thread(rollouts.rollback, tier, who=request.state.key_id, reason=b.reason)
    return r.public()


@get("/history", responses=errors(400, 401, 403, 404, 500), opt={QUERY_OPT: ("tier", "limit")})
async def history(rollouts: NamedDependency[RolloutService], tier: FromQuery[str | None] = None,
                  limit: HistoryLimit = 100) -> dict[str, Any]:
    """The audit trail, latest first: every start, promotion, pause and rollback, with who and why. A `tier` that
    is no tier and has no history is a 404 naming it: a misspelt name (`Mid`) answered an empty trail, which reads
    as a tier never rolled out. A tier the tiers file no longer has keeps its trail."""
    events = await asyncio.to_thread(rollouts.history, tier, limit)
    if tier is not None and not events and tier not in rollouts.catalogue.tiers:
        raise NotFound(f"no tier {tier[:128]!r}; tiers: {', '.join(rollouts.catalogue.tiers)}", param="tier",
                       code="tier_not_found")
    return {"data": [e.public() for e in events]}


rollouts_router = Router(path="/admin/rollouts", guards=[require_admin, only_declared_query], tags=["admin"],
                         security=BEARER, route_handlers=[status, start, promote, pause, rollback, history])
