"""The published OpenAPI document, fetched as a client would: every public route is in it, the chat and
embeddings bodies are our wire models' own schemas (what they refuse, the document refuses), no body offers a field
the gateway refuses by name, and every error answer has OpenAI's shape. (That no answer contradicts it is
test_openapi_fuzz.py's.)"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from gateway.app import create_app
from gateway.errors import InvalidRequest
from gateway.pipeline.handle import parse_request
from gateway.pipeline.text_completion import parse_completion
from gateway.settings import Settings
from tests.conftest import Gateway

ROUTES = {("/v1/chat/completions", "post"), ("/v1/embeddings", "post"), ("/v1/models", "get")}


def _resolve(doc: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_the_document_is_served_and_describes_the_openai_routes(gateway: Gateway) -> None:
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "Tiergate"
    published = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert published >= ROUTES
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = _resolve(doc, chat["requestBody"]["content"]["application/json"]["schema"])
    assert {"model", "messages"} <= set(body["required"]) and body.get("additionalProperties") is False
    assert "text/event-stream" in chat["responses"]["200"]["content"]  # streams are documented too
    for status in ("400", "401", "429"):
        error = _resolve(doc, chat["responses"][status]["content"]["application/json"]["schema"])
        inner = _resolve(doc, error["properties"]["error"])
        assert {"message", "type", "param", "code"} <= set(inner["properties"]), status
    assert httpx.get(f"{gateway.url}/docs", timeout=30).status_code == 200  # the docs page


def test_the_document_needs_no_key_but_the_routes_it_describes_do(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.url}/openapi.json", timeout=30).status_code == 200
    refused = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"]


def test_the_document_is_built_once(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """It needs no key, so building it per request (7.4 ms of the event loop) was work anyone could ask for."""
    first = httpx.get(f"{gateway.url}/openapi.json", timeout=30)
    schema = gateway.app.openapi_schema
    monkeypatch.setattr(type(schema), "to_schema", lambda self: pytest.fail("the document was built again"))
    again = httpx.get(f"{gateway.url}/openapi.json", timeout=30)
    assert again.status_code == 200 and again.content == first.content
    assert again.headers["content-type"].startswith("application/json")


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    """The document as the app publishes it (built from the routes, as tests/gateway/test_openapi_fuzz.py's)."""
    with tempfile.TemporaryDirectory() as data_dir:
        return create_app(Settings(data_dir=Path(data_dir))).openapi_schema.to_schema()


def _bodies(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every operation's JSON request body schema, by path."""
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            content = (operation.get("requestBody") or {}).get("content", {})
            if "application/json" in content:
                yield path, _resolve(doc, content["application/json"]["schema"])


def _objects(node: Any) -> Iterator[dict[str, Any]]:
    """Every object schema (one with `properties`) inside `node`."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            yield node
        for value in node.values():
            yield from _objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from _objects(value)


def test_no_body_offers_a_field_the_gateway_refuses_by_name(document: dict[str, Any]) -> None:
    """gateway/validation.refuse_engine_only refuses `priority` (any value) and `stream_options.
    continuous_usage_stats: true`; a document that offers them has the fuzzer's valid requests refused (it sent the
    second to /v1/completions, and got a 400)."""
    for path, schema in _bodies(document):
        for node in _objects(schema):
            assert "priority" not in node["properties"], path
            if (usage_stats := node["properties"].get("continuous_usage_stats")) is not None:
                assert not jsonschema.Draft202012Validator(usage_stats).is_valid(True), path
                assert jsonschema.Draft202012Validator(usage_stats).is_valid(False), path


MINIMAL: dict[str, tuple[Callable[[bytes], Any], dict[str, Any]]] = {
    "/v1/chat/completions": (parse_request, {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}),
    "/v1/completions": (parse_completion, {"model": "mid", "prompt": "hi"}),
}


@pytest.mark.parametrize("path", MINIMAL)
@pytest.mark.parametrize("fields", [
    {}, {"priority": 0}, {"priority": 7},
    {"stream": True, "stream_options": {"continuous_usage_stats": True}},
    {"stream": True, "stream_options": {"continuous_usage_stats": False, "include_usage": True}},
    {"stream": True, "stream_options": {"continuous_usage_stats": None}},
])
def test_the_document_allows_what_the_gateway_takes_and_no_more(document: dict[str, Any], path: str,
                                                                 fields: dict[str, Any]) -> None:
    """Of the fields the gateway refuses by name, and their neighbours it takes."""
    parse, minimal = MINIMAL[path]
    body = minimal | fields
    schema = next(schema for at, schema in _bodies(document) if at == path)
    try:
        parse(json.dumps(body).encode())
        taken = True
    except InvalidRequest:
        taken = False
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == taken, (body, taken)
