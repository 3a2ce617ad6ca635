"""On-call control of the degradation ladder (admin key): status, set, auto, history, reload."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from litestar import Request, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromQuery
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.auth import require_admin
from gateway.config_files import ConfigFileError
from gateway.errors import InvalidRequest
from gateway.ladder.controller import LadderController
from gateway.ladder.state import event_dict
from gateway.routes.openapi import BEARER, body, errors
from gateway.settings import Settings
from gateway.tenants.keys import MAX_TTL_S
from gateway.validation import parse_body
from wire.fields import integral


class SetLevel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    level: Annotated[int, Field(ge=0)]
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S, allow_inf_nan=False)] | None = None  # finite, ≤ 10 years

    @field_validator("level", mode="before")
    @classmethod
    def _integral(cls, value: object) -> object:
        return integral(value)


@get("/", responses=errors(401, 403, 500))
async def status(ladder: NamedDependency[LadderController]) -> dict[str, Any]:
    return ladder.status()


@post("/", status_code=200, dependencies={"openapi_body": body(SetLevel)}, responses=errors(400, 401, 403, 413, 500))
async def set_level(request: Request[Any, Any, Any], ladder: NamedDependency[LadderController]) -> dict[str, Any]:
    body = parse_body(await request.body(), SetLevel)
    try:
        await asyncio.to_thread(ladder.set_manual, body.level, reason=body.reason, who=request.state.key_id,
                                ttl_s=body.ttl_s)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="level") from exc
    return ladder.status()


@post("/auto", status_code=200, responses=errors(401, 403, 500))
async def set_auto(request: Request[Any, Any, Any], ladder: NamedDependency[LadderController]) -> dict[str, Any]:
    await asyncio.to_thread(ladder.set_auto, who=request.state.key_id)
    return ladder.status()


@get("/history", responses=errors(400, 401, 403, 500))
async def history(ladder: NamedDependency[LadderController], limit: FromQuery[int] = 100) -> dict[str, Any]:
    events = await asyncio.to_thread(ladder.store.history, max(1, min(limit, 1000)))
    return {"data": [event_dict(e) for e in events]}


@post("/reload", status_code=200, responses=errors(400, 401, 403, 500))
async def reload(ladder: NamedDependency[LadderController], settings: NamedDependency[Settings]) -> dict[str, Any]:
    """Re-read the ladder file; a bad file is refused with its line, and the running ladder stays."""
    path = settings.ladder_file
    try:
        await asyncio.to_thread(ladder.reload, path)
    except ConfigFileError as exc:
        raise InvalidRequest(f"ladder not reloaded, the running one stays: {exc}", code="invalid_ladder_file") from exc
    return ladder.status()


degrade_router = Router(path="/admin/degrade", guards=[require_admin], tags=["admin"], security=BEARER,
                        route_handlers=[status, set_level, set_auto, history, reload])
