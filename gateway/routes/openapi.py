"""The published OpenAPI document (/openapi.json, and the docs page at /docs): every route, request body, answer
and error as served. tests/gateway/test_openapi_fuzz.py holds it to that with schemathesis: a request the
document allows is not refused as malformed, one it forbids is, and every answer is one it describes.

Three things make Litestar's generated document say what the handlers really do:

- **Our pydantic models describe themselves.** `WireSchemaPlugin` gives Litestar each model's own JSON schema
  (`model_json_schema`: strict types, bounds, `additionalProperties: false`, the `null`-means-unset rule the wire
  models declare), not Litestar's reading of the model's fields, so the document refuses what the model refuses.
- **Handlers that read the raw body still declare it.** The chat handler must read the body itself (the pipeline
  parses it after the tenant gate, bounded, and counts a bad body as a refusal), so it has no `data` parameter
  for Litestar to document. `body(Model)` is a dependency whose only parameter is `data: Model`; a handler lists
  it in its `dependencies` but never asks for it, so Litestar never calls it (nothing parses the body twice) and
  its generator, which reads a request body from a handler's dependencies too, documents `Model`.
- **Errors have OpenAI's shape.** `errors(...)` declares each status a route answers with `ErrorBody`; a 200 that
  may also be a stream or CSV names its other media types (`also`).

The docs page (/docs) is the document's operations as plain HTML, with no script and nothing from another origin
(`ReferencePage`): it shares its origin with the dashboard, which keeps an admin key in sessionStorage, and Swagger
UI's scripts came from a CDN with no integrity check (whoever served them could read that key).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import html
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, Router, get
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin
from litestar.openapi.spec import Components, OpenAPIMediaType, Operation, SecurityScheme
from litestar.plugins import OpenAPISchemaPlugin
from pydantic import BaseModel

from wire.response_models import ErrorBody

BEARER = [{"bearer": []}, {"api_key": []}]  # a key as `Authorization: Bearer tg-…`, or as `X-API-Key`
_DESCRIPTIONS = {
    400: "The request is malformed or asks for something we do not serve; `param` names the field.",
    401: "No API key, or an unknown, revoked or expired one.",
    403: "The key may not do this (an admin key calling a model, a tenant key on an admin route).",
    404: "No such model (or one outside the key's plan: the same answer), tenant, key or route.",
    409: "An `Idempotency-Key` whose first request is still running, a name that exists already, or a change the "
         "current state forbids (a second rollout on a tier).",
    413: "The body is larger than this gateway accepts.",
    422: "An `Idempotency-Key` reused with another body.",
    429: "Over a rate limit (`Retry-After`, `x-ratelimit-*`), or the budget is spent (`insufficient_quota`).",
    500: "A fault of ours; the message quotes the request id.",
    502: "The tier's backend failed.",
    503: "Not ready, overloaded, shed by the degradation ladder, or a store is down; retry after `Retry-After`.",
    504: "The tier's backend did not answer in time.",
}
MODEL_ERRORS = (400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503, 504)


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """The error answers of a route, each in OpenAI's shape."""
    return {s: ResponseSpec(data_container=ErrorBody, description=_DESCRIPTIONS[s], generate_examples=False)
            for s in statuses}


def body(model: type[BaseModel]) -> Provide:
    """A dependency that documents `model` as the request body and is never called (see the module docstring)."""

    def documents_body(data: Any) -> None:
        raise AssertionError("documents the request body only; handlers read the raw body")

    documents_body.__annotations__ = {"data": model, "return": None}
    return Provide(documents_body, sync_to_thread=False)


def also(*media_types: str, required_body: bool = True) -> type[Operation]:
    """An operation whose 200 may also come as `media_types` (a stream, CSV), each with a plain string schema;
    `required_body=False` for a route that takes an empty body as `{}`."""

    @dataclass
    class _Operation(Operation):
        def __post_init__(self) -> None:
            ok = (self.responses or {}).get("200")
            if ok is not None and not isinstance(ok, dict) and getattr(ok, "content", None) is not None:
                for media_type in media_types:
                    ok.content[media_type] = OpenAPIMediaType(schema={"type": "string"})  # type: ignore[arg-type]
            if self.request_body is not None and not required_body:
                self.request_body.required = False  # type: ignore[union-attr]

    return _Operation


class WireSchemaPlugin(OpenAPISchemaPlugin):
    """Pydantic models, documented by their own JSON schema, as components named after the model."""

    @staticmethod
    def is_plugin_supported_type(value: Any) -> bool:
        return isinstance(value, type) and issubclass(value, BaseModel)

    def to_openapi_schema(self, field_definition: Any, schema_creator: Any) -> Any:
        registry = schema_creator.schema_registry
        schema = registry.get_schema_for_field_definition(field_definition)
        for key, value in _inlined(field_definition.annotation.model_json_schema()).items():
            setattr(schema, _field_name(key), value)
        return registry.get_reference_for_field_definition(field_definition) or schema


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its `$defs` put in place of their references (our models are not recursive)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(copy.deepcopy(defs[ref.removeprefix("#/$defs/")])) | {
                    k: walk(v) for k, v in node.items() if k != "$ref"}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


_SPECIAL = {"not": "schema_not", "if": "schema_if", "else": "schema_else"}


def _field_name(key: str) -> str:
    """A JSON schema keyword as Litestar's `Schema` field: `additionalProperties` is `additional_properties`."""
    return _SPECIAL.get(key) or re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


_STYLE = ("body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:70em;padding:0 1em}"
          "td,th{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}"
          "table{border-collapse:collapse;width:100%}code{white-space:nowrap}")
_STYLE_HASH = base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
# the docs page loads nothing (its one style is inline, allowed by its hash), runs no script, is framed by no one
DOCS_HEADERS = {
    "content-security-policy": f"default-src 'none'; style-src 'sha256-{_STYLE_HASH}'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff", "x-frame-options": "DENY", "referrer-policy": "no-referrer",
}


class ReferencePage(OpenAPIRenderPlugin):
    """/docs: each operation of the document (method, path, summary, description) by tag, and a link to the
    document for an OpenAPI viewer or client generator. Plain HTML made here, every text escaped; no script."""

    def __init__(self) -> None:
        super().__init__(path="/", favicon="", style="")
        self._page: bytes | None = None

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        if self._page is None:  # the document is built once per app, and so is its page
            self._page = _reference(openapi_schema).encode()
        return self._page


def _reference(doc: dict[str, Any]) -> str:
    esc = html.escape
    info = doc.get("info", {})
    by_tag: dict[str, list[str]] = {}
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue  # a path item's own fields (`parameters`, `summary`), not an operation
            text = "".join(f"<p>{esc(part)}</p>" for part in (op.get("summary"), op.get("description")) if part)
            by_tag.setdefault((op.get("tags") or ["other"])[0], []).append(
                f"<tr><td><code>{esc(method.upper())}</code></td><td><code>{esc(path)}</code></td><td>{text}</td></tr>")
    tables = "".join(f"<h2>{esc(tag)}</h2><table><tr><th>method</th><th>path</th><th>what</th></tr>{''.join(rows)}"
                     "</table>" for tag, rows in by_tag.items())
    title = f"{info.get('title', '')} {info.get('version', '')}"
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><style>{_STYLE}</style></head>"
            f"<body><h1>{esc(title)}</h1><p>{esc(info.get('description', ''))}</p><p>The OpenAPI document, with "
            "every request body, answer and error: <a href=\"openapi.json\">openapi.json</a> (open it in any OpenAPI "
            f"viewer or client generator).</p>{tables}</body></html>")


def openapi_config(version: str) -> OpenAPIConfig:
    """The document and its docs page: a plain reference page at /docs (ReferencePage: no script), the JSON at
    /docs/openapi.json and, where clients look for it, /openapi.json."""
    return OpenAPIConfig(
        title="Tiergate", version=version, path="/docs",
        description="A cost-aware, multi-tenant gateway for language models, OpenAI-compatible. Errors have OpenAI's "
                    "shape: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}.",
        render_plugins=[ReferencePage(), JsonRenderPlugin(path="/openapi.json")],
        openapi_router=Router("/docs", route_handlers=[], include_in_schema=False, response_headers=DOCS_HEADERS),
        components=Components(security_schemes={
            "bearer": SecurityScheme(type="http", scheme="bearer", description="an API key: `tg-…`"),
            "api_key": SecurityScheme(type="apiKey", name="X-API-Key", security_scheme_in="header",
                                      description="the same key, for clients that cannot send a bearer token"),
        }),
        use_handler_docstrings=True, create_examples=False,
    )


@get("/openapi.json", include_in_schema=False, sync_to_thread=False)
def openapi_document(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The document at the root, where OpenAI-style tools look for it: built once per app (it needs no key, and
    building it took 7.4 ms of the event loop a request, against Litestar's cached copy at /docs/openapi.json)."""
    state = request.app.state
    if (document := state.get("openapi_document")) is None:
        document = state.openapi_document = msgspec.json.encode(request.app.openapi_schema.to_schema())
    return Response(document, media_type="application/json")
