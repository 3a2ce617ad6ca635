"""Refused by name, in OpenAI's error shape with `param` and `code`, never ignored: a usage report's unknown query
parameters and its invalid ones (in words, not a Python repr), a compressed body (415, not "broken JSON"), and the
chat fields that need another (and the published document says so)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.conftest import Gateway

CHAT = {"model": "mid", "messages": [{"role": "user", "content": "hello"}]}


def error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_a_usage_report_refuses_what_it_does_not_take(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        assert c.get("/v1/usage", params={"from": "2024-01-01", "to": "2024-01-02", "by": "day"}).status_code == 200
        for name in ("form", "tenant"):  # a misspelt `from`; another tenant's usage
            r = c.get("/v1/usage", params={name: "2024-01-01"})
            assert r.status_code == 400 and error(r)["param"] == name and error(r)["code"] == "unsupported_parameter"
        r = c.get("/v1/usage", params={"format": "xml"})
        err = error(r)
        assert r.status_code == 400 and err["param"] == "format" and err["code"] == "invalid_value"
        assert "<" not in err["message"] and "ParamType" not in err["message"] and "xml" in err["message"]
    with gateway.client(gateway.admin_key) as admin:
        assert admin.get("/admin/usage/report", params={"tenant": "acme", "by": "tier"}).status_code == 200
        r = admin.get("/admin/usage/report", params={"tenants": "acme"})
        assert r.status_code == 400 and error(r)["param"] == "tenants"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_compressed_body_is_refused_as_such(gateway: Gateway, encoding: str) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", content=gzip.compress(json.dumps(CHAT).encode()),
                   headers={"content-type": "application/json", "content-encoding": encoding})
        assert r.status_code == 415 and error(r)["code"] == "unsupported_content_encoding", r.text
        r = c.post("/v1/chat/completions", content=json.dumps(CHAT),
                   headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text
    assert len(gateway.stub.requests) == 1


@pytest.mark.parametrize(("fields", "param"), [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_a_field_without_the_one_it_needs_is_refused(gateway: Gateway, fields: dict, param: str) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=CHAT | fields)
    err = error(r)
    assert r.status_code == 400 and err["param"] == param and "Value error" not in err["message"], r.text
    assert gateway.stub.requests == []


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TEXT = {"model": "mid", "prompt": "hi"}


@pytest.mark.parametrize(("path", "refused", "accepted"), [
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, {"stream": True}),
    ("/v1/chat/completions", {"parallel_tool_calls": True}, {"tools": TOOLS}),
    ("/v1/completions", {"stream": False, "stream_options": {"include_usage": True}}, {"stream": True}),
], ids=["chat-stream-options", "chat-parallel-calls", "text-stream-options"])
def test_the_document_says_so(tmp_path: Path, path: str, refused: dict, accepted: dict) -> None:
    doc = create_app(Settings(data_dir=tmp_path)).openapi_schema.to_schema()
    request = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator(request | {"components": doc["components"]})
    body = (CHAT if "chat" in path else TEXT) | refused
    assert not validator.is_valid(body) and validator.is_valid(body | accepted)
