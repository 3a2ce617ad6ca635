"""The admin POST routes that take no body (revoke a key, bump a tenant's data version, hand the ladder back to its
triggers, reload the ladder file): a body is refused, never read past.

Each did its change whatever body came with it: `{"path": "/etc/other-ladder.yaml"}` to /admin/degrade/reload
reloaded the configured file and answered 200, `{"reason": "incident 42"}` to /admin/degrade/auto was written
nowhere, and the caller read both as done as asked. A field these routes do not take is refused by name (400
`unsupported_parameter`, the body's first unknown field), a body that is no JSON object as any body is; no body at
all, or `{}` (what a client that always sends JSON sends), is the request."""

from __future__ import annotations

from typing import Any

from litestar import Request
from pydantic import BaseModel, ConfigDict, model_validator

from gateway.validation import parse_change_body
from wire.fields import one_unknown


class NoBody(BaseModel):
    """A body without fields: `{}`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _first_unknown(cls, data: Any) -> Any:
        return one_unknown(data, cls)  # one error, not one per field (wire/fields.py says why)


async def refuse_body(request: Request[Any, Any, Any]) -> None:
    """The 400 (InvalidRequest, as for any refused body) for a body with anything in it; none, or `{}`, passes."""
    raw = await request.body()
    if raw.strip():
        parse_change_body(raw, NoBody)
