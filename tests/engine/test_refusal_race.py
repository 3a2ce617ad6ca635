"""A request whose response format is refused to its tenant after the server's checks passed and before `generate`
checks it again (another of the tenant's requests ran past the schema's limits meanwhile) is the 400 those checks
would have given, naming the param: for a whole answer its status, for a stream (headers sent) its last event before
`[DONE]`; never a 500 / `engine_error`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.llm_engine import LLMEngine
from tests.engine.fakes import ScriptedRunner, serving
from tests.engine.test_server import byte_level_tokenizer


@pytest.fixture(scope="module")
def racing() -> Iterator[str]:
    """An engine whose every new schema is refused to its tenant just after it is compiled: after the server's
    `prepare` and its compile, before `generate`'s own check."""
    eng = LLMEngine(ScriptedRunner(reply='{"a": 1}', max_model_len=4096, num_kv_blocks=512), byte_level_tokenizer())
    real = eng.compiled_grammar

    async def compiled_then_refused(params: Any, tenant: str | None) -> Any:
        grammar = await real(params, tenant)
        eng.grammars.ran_past_limits(grammar.key, tenant, "GrammarLimitError: 3999 items")  # another request failed
        return grammar

    eng.compiled_grammar = compiled_then_refused  # type: ignore[method-assign]
    with serving(eng) as url:
        yield url


def schema(name: str) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": "integer"}}}


def chat_body(name: str, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema(name)}}, **kw}


def refused_as(error: dict[str, Any], param: str) -> None:
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == "invalid_value"
    assert "ran past its grammar's limits" in error["message"]


def test_whole_chat_answer_is_the_400(racing: str) -> None:
    r = httpx.post(f"{racing}/v1/chat/completions", json=chat_body("whole"), timeout=30)
    assert r.status_code == 400, r.text
    refused_as(r.json()["error"], "response_format")


def test_whole_text_answer_is_the_400(racing: str) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema("text")}}}
    r = httpx.post(f"{racing}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    refused_as(r.json()["error"], "response_format")


def test_required_tool_call_names_tools(racing: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema("tool")}}],
            "tool_choice": "required"}
    r = httpx.post(f"{racing}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and error["code"] == "invalid_value", error


def test_stream_ends_with_the_400s_error(racing: str) -> None:
    r = httpx.post(f"{racing}/v1/chat/completions", json=chat_body("stream", stream=True), timeout=30)
    assert r.status_code == 200  # the opening chunk is sent before the request starts
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    refused_as(json.loads(events[-2])["error"], "response_format")
    assert json.loads(events[-2])["error"]["status"] == 400  # what the gateway reads it as (tiers/client.py)
    assert all("error" not in json.loads(e) for e in events[:-2])
