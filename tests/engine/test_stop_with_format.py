"""The engine refuses `stop` beside an answer whose shape is forced (naming `stop`, `unsupported_value`): in its
SamplingParams check, for callers that do not come through its HTTP server, and at its server's validation.

A stop match ends the sequence whatever the grammar still needs (engine/llm_engine.py's `_stream`), so a strict
json_schema answer with `stop: ['"']` was `{` and a required call with `stop: ["get_weather"]` was the content
`{"name": "`, each with finish_reason "stop". Under tool_choice "auto" (no grammar) a stop inside the call's JSON
left its `<tool_call>` wrapper as the answer's text: the scripted answer below, with `stop: ["}"]`, came back as the
content `Checking. <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"` and no tool_calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.llm_engine import EngineInputError, LLMEngine
from engine.sampling_params import SamplingParams
from engine.tool_calls import answer_format
from tests.engine.fakes import CharTokenizer, ScriptedRunner, scripted_server
from wire.chat_request import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
MSG = [{"role": "user", "content": "Weather in Paris?"}]
CALL = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def call_format(choice: Any) -> Any:
    """What the engine's sampler enforces for a request whose tool_choice is `choice`: the call schema."""
    return answer_format(ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": MSG, "tools": TOOLS, "tool_choice": choice}))


FORMATS = {
    "json_object": lambda: {"type": "json_object"},
    "json_schema": lambda: SCHEMA,
    "required_call": lambda: call_format("required"),
    "named_call": lambda: call_format({"type": "function", "function": {"name": "get_weather"}}),
}


@pytest.mark.parametrize("stop", [['"'], ["}"], ["get_weather", "\n"]])
@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_sampling_params_refuse_stop_beside_a_format(fmt: Any, stop: list[str]) -> None:
    with pytest.raises(EngineInputError) as err:
        SamplingParams(temperature=0, stop=stop, response_format=fmt())
    assert (err.value.param, err.value.code) == ("stop", "unsupported_value")
    assert str(err.value).startswith("stop: a stop sequence would cut the JSON/tool call short")


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_format_without_stop_and_stop_without_a_format_are_accepted(fmt: Any) -> None:
    assert SamplingParams(response_format=fmt(), stop=[]).output_format is not None
    assert SamplingParams(stop=["}"], response_format={"type": "text"}).stop == ["}"]
    assert SamplingParams(stop=["}"]).stop == ["}"]


async def test_a_direct_caller_who_adds_stop_after_the_check_is_refused() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer())
    eng.start()
    try:
        params = SamplingParams(temperature=0, response_format={"type": "json_object"})
        params.stop = ["}"]  # a dataclass can be changed after it was checked
        with pytest.raises(EngineInputError) as err:
            await anext(eng.generate([1, 2], params))
        assert err.value.param == "stop" and eng.dead_reason is None
    finally:
        eng.shutdown()


@pytest.fixture
def served() -> Iterator[tuple[str, ScriptedRunner]]:
    runner = ScriptedRunner(reply=CALL, max_model_len=2048)
    with scripted_server(runner) as url:
        yield url, runner


REFUSED = {
    "auto": ("chat", {"tools": TOOLS}),
    "required": ("chat", {"tools": TOOLS, "tool_choice": "required"}),
    "json_schema": ("chat", {"response_format": SCHEMA}),
    "text_json_object": ("completions", {"response_format": {"type": "json_object"}}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("route", "shape"), list(REFUSED.values()), ids=list(REFUSED))
def test_the_engine_server_refuses_stop_beside_a_shape_before_generating(
        served: tuple[str, ScriptedRunner], route: str, shape: dict[str, Any], stream: bool) -> None:
    url, runner = served
    body = ({"messages": MSG} if route == "chat" else {"prompt": "Weather?"}) | {
        "model": "tiny", "max_tokens": 200, "stream": stream, "stop": ["}"], **shape}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "stop", "unsupported_value")
    assert error["message"].startswith("stop: a stop sequence would cut the "), error
    assert runner.order == []  # nothing was generated


def test_without_stop_the_auto_call_is_parsed(served: tuple[str, ScriptedRunner]) -> None:
    url, _ = served
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "tools": TOOLS,
                                                       "max_tokens": 200}, timeout=30)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
