"""Through the gateway, `stop` beside an answer whose shape the request sets (response_format json_object or
json_schema; tools under tool_choice "required", a named function or "auto") is a 400 naming `stop`, in OpenAI's error
shape, before anything is spent: no quota reserved, no tier called, no ledger row. It was admitted, routed and
billed, and a stop string met inside the JSON or the call cut the answer short, reading as complete."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Gateway
from tests.gateway.raw_http import wait_for_rows
from tests.gateway.test_schema_refused_before_admission import reserves

MSG = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}

CASES = {
    "required": ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                          "stop": ["get_weather"]}),
    "named": ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "stop": ["}"],
                                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "auto": ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "stop": "}"}),
    "json_schema": ("/v1/chat/completions", {"messages": MSG, "response_format": SCHEMA, "stop": ['"']}),
    "json_object_streamed": ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"},
                                                      "stop": ["{", "}"], "stream": True}),
    "text_json_object": ("/v1/completions", {"prompt": "Weather?", "response_format": {"type": "json_object"},
                                             "stop": ["}"]}),
}


@pytest.mark.parametrize(("path", "body"), list(CASES.values()), ids=list(CASES))
def test_stop_beside_a_shaped_answer_is_refused_before_anything_is_spent(gateway: Gateway, path: str,
                                                                         body: dict[str, Any]) -> None:
    asked = reserves(gateway)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post(path, json={"model": "mid", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "stop",
                                                                  "unsupported_value"), error
        assert error["message"].startswith("stop: a stop sequence would cut the "), error
        assert not gateway.stub.requests and not asked
        # the same request without its stop is served (and billed): the refused one was not (a stub tier's
        # /v1/completions takes no response_format: that one goes without it too)
        dropped = {"stop"} if path == "/v1/chat/completions" else {"stop", "response_format"}
        ok = c.post(path, json={"model": "mid", **{k: v for k, v in body.items() if k not in dropped}})
        assert ok.status_code == 200, ok.text
    rows = wait_for_rows(gateway, 1)
    assert len(rows) == 1 and len(asked) == 1 and len(gateway.stub.requests) == 1
    assert "stop" not in gateway.stub.requests[0]


def test_stop_with_a_text_format_or_without_tools_is_served(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for body in ({"stop": ["}"], "response_format": {"type": "text"}},
                     {"stop": ["}"], "tools": TOOLS, "tool_choice": "none"},
                     {"stop": [], "response_format": SCHEMA}):
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, **body})
            assert r.status_code == 200, (body, r.text)
    assert len(gateway.stub.requests) == 3
    assert [req["stop"] for req in gateway.stub.requests[:2]] == [["}"], ["}"]]  # passed on as sent
