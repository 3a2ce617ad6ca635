"""The published OpenAPI document, fetched as a client would: every public route is in it, the chat and
embeddings bodies are our wire models' own schemas (what they refuse, the document refuses), and every error
answer has OpenAI's shape. (That no answer contradicts it is test_openapi_fuzz.py's.)"""

from __future__ import annotations

import httpx
import pytest

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
