"""Admin routes (admin key required): tenants, keys, usage. The CLI does the same on the same state.

Each store call goes through `TenantStore.admin` (off the event loop): a write that waits for another writer's lock
waits there, while every tenant's requests are served."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import require_admin
from gateway.errors import InvalidRequest
from gateway.pipeline.cache_lookup import CacheStage
from gateway.query_params import QUERY_OPT, only_declared_query
from gateway.routes.bodiless import refuse_body
from gateway.routes.openapi import BEARER, also, body, errors
from gateway.tenants.keys import MAX_GRACE_S, MAX_TTL_S, MIN_KEY_TTL_S
from gateway.tenants.records import ADMIN
from gateway.tenants.rules import KEY_NAME_PATTERN, NAME_RE
from gateway.tenants.store import TenantStore
from gateway.validation import parse_change_body
from quotas.plans import Limits, PlanBook


class CreateTenant(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=NAME_RE.pattern)]
    plan: str | None = None


# seconds a key lives: finite (JSON's NaN, Infinity and 1e400 are refused), at least a second (as a degrade level's
# TTL), at most ten years. Any positive number was taken: 1e-300 issued a key whose `expires_at` was its `created_at`,
# dead when shown "once; store it now", and a rotation with it revoked the old key after its grace for a new one
# that never worked (gateway/tenants/keys.py)
TtlSeconds = Annotated[float, Field(ge=MIN_KEY_TTL_S, le=MAX_TTL_S, allow_inf_nan=False)]


def _tenant_or_admin(schema: dict[str, Any]) -> None:
    """The document says what the store enforces: a tenant's key, or an admin key that belongs to no tenant."""
    schema["oneOf"] = [
        {"required": ["tenant"], "properties": {"tenant": {"type": "string"}, "admin": {"const": False}}},
        # an admin key calls no model: limits would never apply to it, so it has none (`issue_key` refuses them)
        {"required": ["admin"], "properties": {"admin": {"const": True}, "tenant": {"type": "null"}, "limits": {
            "anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                                         "properties": {name: {"type": "null"} for name in Limits.model_fields}}]}}},
    ]


class IssueKey(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_tenant_or_admin)
    tenant: str | None = None  # exactly one of a tenant or `admin`: an admin key belongs to no tenant
    name: Annotated[str, Field(max_length=128, json_schema_extra={"pattern": KEY_NAME_PATTERN})] = ""  # the store's
    admin: bool = False
    ttl_s: TtlSeconds | None = None
    limits: Limits | None = None  # this key's own limits, on top of the tenant's plan


class RotateKey(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    grace_s: Annotated[float, Field(ge=0, le=MAX_GRACE_S, allow_inf_nan=False)] = 0.0
    ttl_s: TtlSeconds | None = None  # the new key's; it never outlives the old key's expiry


ADMIN_ERRORS = errors(400, 401, 403, 404, 409, 413, 500)


@get("/tenants", responses=errors(400, 401, 403, 500))
async def list_tenants(store: NamedDependency[TenantStore]) -> dict[str, Any]:
    return {"data": [vars(t) for t in await store.admin(store.list_tenants)]}


@post("/tenants", status_code=201, dependencies={"openapi_body": body(CreateTenant)}, responses=ADMIN_ERRORS)
async def create_tenant(request: Request[Any, Any, Any], store: NamedDependency[TenantStore],
                        plans: NamedDependency[PlanBook]) -> dict[str, Any]:
    body = parse_change_body(await request.body(), CreateTenant)
    # left out or null: the default plan; "" is a plan name like any other, refused below (it became the default
    # plan, a tenant created on a plan the caller did not ask for)
    plan = body.plan if body.plan is not None else plans.default_plan
    if plan not in plans.plans:
        raise InvalidRequest(f"no plan {plan[:64]!r}; plans: {', '.join(plans.plans)}", param="plan",
                             code="plan_not_found")
    return vars(await store.admin(store.create_tenant, body.name, plan))


@post("/tenants/{name:str}/data-version", status_code=200, responses=errors(400, 401, 403, 404, 500))
async def bump_data_version(request: Request[Any, Any, Any], store: NamedDependency[TenantStore],
                            cache: NamedDependency[CacheStage], name: FromPath[str]) -> dict[str, Any]:
    """The tenant's data changed: cached answers made from the old data become unreachable at once, and are
    deleted (from the store every process shares, and from each process's index as it follows the store)."""
    await refuse_body(request)
    version = await store.admin(store.bump_data_version, name)
    await cache.bump_data_version(name, version)
    return {"tenant": name, "data_version": version}


@get("/keys", responses=errors(400, 401, 403, 404, 500), opt={QUERY_OPT: ("tenant",)})
async def list_keys(store: NamedDependency[TenantStore], tenant: FromQuery[str | None] = None) -> dict[str, Any]:
    """Every key, or `tenant`'s: a tenant the store does not have is a 404 naming it (a misspelt name answered an
    empty list, which reads as a tenant without keys)."""
    return {"data": await store.admin(_keys, store, tenant)}


def _keys(store: TenantStore, tenant: str | None) -> list[dict[str, object]]:
    if tenant is not None:
        store.get_tenant(tenant)
    return [k.public() for k in store.list_keys(tenant)]


@post("/keys", status_code=201, dependencies={"openapi_body": body(IssueKey)}, responses=ADMIN_ERRORS)
async def issue_key(request: Request[Any, Any, Any], store: NamedDependency[TenantStore]) -> dict[str, Any]:
    body = parse_change_body(await request.body(), IssueKey)
    if body.admin and body.limits is not None and body.limits != Limits():
        # an admin key calls no model, so its limits would never apply: the caller meant a tenant key, or nothing
        raise InvalidRequest("an admin key calls no models, so limits would never apply to it; leave them out, or "
                             "issue a tenant key", param="limits", code="admin_key_with_limits")
    key, plaintext = await store.admin(
        store.issue_key, body.tenant, name=body.name, roles=(ADMIN,) if body.admin else (), ttl_s=body.ttl_s,
        limits=body.limits)
    return key.public() | {"key": plaintext, "note": "shown once; store it now"}


@post("/keys/{key_id:str}/revoke", status_code=200, responses=errors(400, 401, 403, 404, 500))
async def revoke_key(request: Request[Any, Any, Any], store: NamedDependency[TenantStore],
                     key_id: FromPath[str]) -> dict[str, Any]:
    await refuse_body(request)
    return (await store.admin(store.revoke_key, key_id)).public()


@post("/keys/{key_id:str}/rotate", status_code=201, dependencies={"openapi_body": body(RotateKey)},
      responses=ADMIN_ERRORS, operation_class=also(required_body=False))
async def rotate_key(request: Request[Any, Any, Any], store: NamedDependency[TenantStore],
                     key_id: FromPath[str]) -> dict[str, Any]:
    raw = await request.body()
    body = parse_change_body(raw, RotateKey) if raw.strip() else RotateKey()
    key, plaintext = await store.admin(store.rotate_key, key_id, grace_s=body.grace_s, ttl_s=body.ttl_s)
    return key.public() | {"key": plaintext, "replaces": key_id, "note": "shown once; store it now"}


admin_router = Router(
    path="/admin", guards=[require_admin, only_declared_query], tags=["admin"], security=BEARER,
    route_handlers=[list_tenants, create_tenant, bump_data_version, list_keys, issue_key, revoke_key, rotate_key],
)
