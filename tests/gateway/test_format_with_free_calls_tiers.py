"""`response_format` on a chat request whose model may still call tools (tool_choice `auto`) is honoured by tiers
whose server constrains the two together (OpenAI's, vLLM's); our engine enforces one grammar an answer and refused
such a request only once the gateway had routed and reserved it. Now a `tiergate` tier never gets one: named, it is a
400 naming `response_format` before anything is spent; `auto` passes it over; a plan with no tier that can is refused
by name. A required or `none` tool_choice, or no response_format, goes anywhere. Through a real gateway in front of
stubs that record the bodies they get, `mid` (the plans' default) speaking our engine's dialect."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Gateway
from tests.gateway.dialect_tiers import dialect_gateway, key_of

OURS = {"small": "vllm", "mid": "tiergate", "full": "vllm"}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
FREE = {"tools": TOOLS, "response_format": SCHEMA}  # tool_choice unset: `auto`


@pytest.fixture
def gw(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    with dialect_gateway(tmp_path, prepared_models, OURS) as gateway:
        yield gateway


def chat(gw: Gateway, body: dict[str, Any], key: str | None = None) -> Any:
    with gw.client(key or gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
                                                    **body})


@pytest.mark.parametrize("choice", [None, "auto"], ids=["unset", "auto"])
def test_a_format_with_free_calls_named_for_our_engine_is_refused_by_name_before_anything_is_spent(
        gw: Gateway, choice: str | None) -> None:
    body = {**FREE, **({"tool_choice": choice} if choice else {})}
    r = chat(gw, {"model": "mid", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "unsupported_parameter", error
    assert "'mid'" in error["message"] and "tool_choice" in error["message"], error
    assert gw.stub.requests == [] and gw.ledger_rows() == []  # nothing sent, nothing reserved or billed
    served = chat(gw, {"model": "full", **body})  # a vLLM takes both
    assert served.status_code == 200, served.text
    sent = gw.stub.requests[-1]
    assert sent["model"] == "stub-full" and sent["response_format"] == SCHEMA and sent["tools"] == TOOLS


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": "none", "response_format": SCHEMA},
    {"tools": TOOLS, "tool_choice": "required", "response_format": SCHEMA},
    {"tools": TOOLS},
    {"response_format": SCHEMA},
], ids=["choice none", "choice required", "no format", "no tools"])
def test_what_one_grammar_can_enforce_goes_to_our_engine(gw: Gateway, body: dict[str, Any]) -> None:
    r = chat(gw, {"model": "mid", **body})
    assert r.status_code == 200, r.text
    assert gw.stub.requests[-1]["model"] == "stub-mid"


def test_auto_passes_our_engine_over(gw: Gateway) -> None:
    plain = chat(gw, {"model": "auto", "tools": TOOLS})
    assert plain.headers["x-tiergate-tier"] == "mid", plain.text  # the plan's default
    formatted = chat(gw, {"model": "auto", **FREE})
    assert formatted.status_code == 200, formatted.text
    assert formatted.headers["x-tiergate-tier"] != "mid"
    assert [b["model"] for b in gw.stub.requests].count("stub-mid") == 1  # the first request's only


def test_a_plan_with_no_tier_that_can_is_refused_by_name(gw: Gateway) -> None:
    r = chat(gw, {"model": "auto", **FREE}, key_of(gw, "plain"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert gw.stub.requests == []
