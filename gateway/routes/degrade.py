"""On-call control of the degradation ladder (admin key): status, set, auto, history, reload.

A change whose shared state cannot be written (Redis or the fleet database down, after a retry) is a 503 in OpenAI's
shape that says so, with Retry-After; this replica's view of the state stays as it was (the controller takes a state
only once it is saved)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from litestar import Request, Router, get, post
from litestar.di import NamedDependency
from litestar.params import QueryParameter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.auth import require_admin
from gateway.config_files import ConfigFileError
from gateway.errors import InvalidRequest
from gateway.ladder.config import unknown_tiers
from gateway.ladder.controller import MIN_TTL_S, REASON_PATTERN, LadderChangeError, LadderController
from gateway.ladder.state import event_dict
from gateway.query_params import QUERY_OPT, only_declared_query
from gateway.routes.bodiless import refuse_body
from gateway.routes.openapi import BEARER, body, errors
from gateway.settings import Settings
from gateway.tenants.keys import MAX_TTL_S
from gateway.validation import parse_change_body
from tiers.fleet import Fleet
from wire.fields import integral

# how many events a history gives, latest first: 1 to 1000, refused by name outside (-5 was read as 1); the
# rollouts' history takes the same
HistoryLimit = Annotated[int, QueryParameter(ge=1, le=1000, description="events, latest first: 1 to 1000")]


class SetLevel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    level: Annotated[int, Field(ge=0)]
    # one line, not only blanks (the controller refuses the rest by name: a newline went into the log as it was)
    reason: Annotated[str, Field(min_length=1, max_length=500, json_schema_extra={"pattern": REASON_PATTERN})]
    # finite, 1 s to 10 years (1e-300 was taken: a level that had ended when it was set); none: until `auto`
    ttl_s: Annotated[float, Field(ge=MIN_TTL_S, le=MAX_TTL_S, allow_inf_nan=False)] | None = None

    @field_validator("level", mode="before")
    @classmethod
    def _integral(cls, value: object) -> object:
        return integral(value)


async def _changing(change: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run `change` in a worker thread (it reads and writes the shared store). If it fails (a store that cannot be
    written: 503), the controller's state is the one from before: it takes a state only once it is saved."""
    await asyncio.to_thread(change, *args, **kwargs)


@get("/", responses=errors(400, 401, 403, 500))
async def status(ladder: NamedDependency[LadderController]) -> dict[str, Any]:
    return ladder.status()


@post("/", status_code=200, dependencies={"openapi_body": body(SetLevel)},
      responses=errors(400, 401, 403, 413, 500, 503))
async def set_level(request: Request[Any, Any, Any], ladder: NamedDependency[LadderController]) -> dict[str, Any]:
    body = parse_change_body(await request.body(), SetLevel)
    try:
        await _changing(ladder.set_manual, body.level, reason=body.reason, who=request.state.key_id,
                        ttl_s=body.ttl_s)
    except LadderChangeError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code=exc.code) from exc
    return ladder.status()


@post("/auto", status_code=200, responses=errors(400, 401, 403, 500, 503))
async def set_auto(request: Request[Any, Any, Any], ladder: NamedDependency[LadderController]) -> dict[str, Any]:
    await refuse_body(request)
    await _changing(ladder.set_auto, who=request.state.key_id)
    return ladder.status()


@get("/history", responses=errors(400, 401, 403, 500, 503), opt={QUERY_OPT: ("limit",)})
async def history(ladder: NamedDependency[LadderController], limit: HistoryLimit = 100) -> dict[str, Any]:
    events = await asyncio.to_thread(ladder.store.history, limit)
    return {"data": [event_dict(e) for e in events]}


@post("/reload", status_code=200, responses=errors(400, 401, 403, 500, 503))
async def reload(request: Request[Any, Any, Any], ladder: NamedDependency[LadderController],
                 settings: NamedDependency[Settings], fleet: NamedDependency[Fleet]) -> dict[str, Any]:
    """Re-read the ladder file (the configured one: the route takes no body); a bad file is refused with its line,
    and the running ladder stays. The answer is the new status, with `unknown_tiers`: the tier names its remaps use
    that the tiers file does not have (a misspelt name?), empty when none. The new ladder's identity goes into the
    shared state (a 503 when it cannot be written: then nothing changed), and every other worker and replica takes
    the same ladder from its own copy of the file at its next tick or change; one that cannot says so in its status
    (`ladder.in_sync`, `ladder.error`) and its log (gateway/ladder/controller.py)."""
    await refuse_body(request)
    path = settings.ladder_file
    tiers = list(fleet.catalogue.tiers)
    try:
        await _changing(ladder.reload, path, tiers)
    except ConfigFileError as exc:
        raise InvalidRequest(f"ladder not reloaded, the running one stays: {exc}", code="invalid_ladder_file") from exc
    return {**ladder.status(), "unknown_tiers": unknown_tiers(ladder.ladder, tiers)}


degrade_router = Router(path="/admin/degrade", guards=[require_admin, only_declared_query], tags=["admin"],
                        security=BEARER, route_handlers=[status, set_level, set_auto, history, reload])
