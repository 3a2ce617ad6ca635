"""On-call control of the degradation ladder (admin key): status, set, auto, history, reload."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from litestar import Request, Router, get, post
from litestar.params import FromQuery
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import require_admin
from gateway.config_files import ConfigFileError
from gateway.errors import InvalidRequest
from gateway.ladder.state import event_dict
from gateway.validation import parse_body


class SetLevel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    level: Annotated[int, Field(ge=0)]
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    ttl_s: Annotated[float, Field(gt=0)] | None = None


def _ladder(request: Request[Any, Any, Any]) -> Any:
    return request.app.state.services.ladder


@get("/")
async def status(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _ladder(request).status()


@post("/", status_code=200)
async def set_level(request: Request[Any, Any, Any]) -> dict[str, Any]:
    body = parse_body(await request.body(), SetLevel)
    ladder = _ladder(request)
    try:
        await asyncio.to_thread(ladder.set_manual, body.level, reason=body.reason, who=request.state.key_id,
                                ttl_s=body.ttl_s)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="level") from exc
    return ladder.status()


@post("/auto", status_code=200)
async def set_auto(request: Request[Any, Any, Any]) -> dict[str, Any]:
    ladder = _ladder(request)
    await asyncio.to_thread(ladder.set_auto, who=request.state.key_id)
    return ladder.status()


@get("/history")
async def history(request: Request[Any, Any, Any], limit: FromQuery[int] = 100) -> dict[str, Any]:
    events = await asyncio.to_thread(_ladder(request).store.history, max(1, min(limit, 1000)))
    return {"data": [event_dict(e) for e in events]}


@post("/reload", status_code=200)
async def reload(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Re-read the ladder file; a bad file is refused with its line, and the running ladder stays."""
    ladder = _ladder(request)
    path = request.app.state.services.settings.ladder_file
    try:
        await asyncio.to_thread(ladder.reload, path)
    except ConfigFileError as exc:
        raise InvalidRequest(f"ladder not reloaded, the running one stays: {exc}", code="invalid_ladder_file") from exc
    return ladder.status()


degrade_router = Router(path="/admin/degrade", guards=[require_admin],
                        route_handlers=[status, set_level, set_auto, history, reload])
