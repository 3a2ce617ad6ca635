"""Admin routes (admin key required): tenants, keys, usage. The CLI does the same on the same state."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Router, get, post
from litestar.params import FromPath, FromQuery
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import require_admin
from gateway.errors import InvalidRequest
from gateway.tenants.store import ADMIN
from gateway.validation import parse_body
from quotas.plans import Limits


class CreateTenant(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=64)]
    plan: str | None = None


class IssueKey(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    tenant: str | None = None
    name: Annotated[str, Field(max_length=128)] = ""
    admin: bool = False
    ttl_s: Annotated[float, Field(gt=0)] | None = None
    limits: Limits | None = None  # this key's own limits, on top of the tenant's plan


class RotateKey(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    grace_s: Annotated[float, Field(ge=0)] = 0.0


def _services(request: Request[Any, Any, Any]) -> Any:
    return request.app.state.services


@get("/tenants")
async def list_tenants(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return {"data": [vars(t) for t in _services(request).store.list_tenants()]}


@post("/tenants", status_code=201)
async def create_tenant(request: Request[Any, Any, Any]) -> dict[str, Any]:
    body = parse_body(await request.body(), CreateTenant)
    services = _services(request)
    plan = body.plan or services.plans.default_plan
    if plan not in services.plans.plans:
        raise InvalidRequest(f"no plan {plan!r}; plans: {', '.join(services.plans.plans)}", param="plan")
    return vars(services.store.create_tenant(body.name, plan))


@post("/tenants/{name:str}/data-version", status_code=200)
async def bump_data_version(request: Request[Any, Any, Any], name: FromPath[str]) -> dict[str, Any]:
    """The tenant's data changed: cached answers made from the old data become unreachable at once."""
    return {"tenant": name, "data_version": _services(request).store.bump_data_version(name)}


@get("/keys")
async def list_keys(request: Request[Any, Any, Any], tenant: FromQuery[str | None] = None) -> dict[str, Any]:
    return {"data": [k.public() for k in _services(request).store.list_keys(tenant)]}


@post("/keys", status_code=201)
async def issue_key(request: Request[Any, Any, Any]) -> dict[str, Any]:
    import time

    body = parse_body(await request.body(), IssueKey)
    expires = time.time() + body.ttl_s if body.ttl_s else None
    key, plaintext = _services(request).store.issue_key(
        body.tenant, name=body.name, roles=(ADMIN,) if body.admin else (), expires_at=expires, limits=body.limits)
    return key.public() | {"key": plaintext, "note": "shown once; store it now"}


@post("/keys/{key_id:str}/revoke", status_code=200)
async def revoke_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> dict[str, Any]:
    return _services(request).store.revoke_key(key_id).public()


@post("/keys/{key_id:str}/rotate", status_code=201)
async def rotate_key(request: Request[Any, Any, Any], key_id: FromPath[str]) -> dict[str, Any]:
    raw = await request.body()
    body = parse_body(raw, RotateKey) if raw.strip() else RotateKey()
    key, plaintext = _services(request).store.rotate_key(key_id, grace_s=body.grace_s)
    return key.public() | {"key": plaintext, "replaces": key_id, "note": "shown once; store it now"}


admin_router = Router(
    path="/admin", guards=[require_admin],
    route_handlers=[list_tenants, create_tenant, bump_data_version, list_keys, issue_key, revoke_key, rotate_key],
)
