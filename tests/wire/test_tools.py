"""The tool-calling fields of the chat request: what is accepted, and the 400s (OpenAI's shape, naming the field) for
what is not; tools rendered into the prompt and the model's answer parsed back (wire/tool_calls.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from wire.chat_request import ChatCompletionRequest, ChatMessage
from wire.response_format import MAX_SCHEMA_DEPTH
from wire.tool_calls import MAX_BLOCKS_TRIED, call_schema, parse_answer, parse_constrained, render_messages
from wire.tools import MAX_TOOLS, MAX_TOOLS_BYTES
from wire.validation import BodyError, parse_body

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def request(**fields: Any) -> ChatCompletionRequest:
    return parse_body(json.dumps({"model": "m", "messages": USER, **fields}).encode(), ChatCompletionRequest)


def refusal(**fields: Any) -> BodyError:
    with pytest.raises(BodyError) as err:
        request(**fields)
    return err.value


def test_a_tool_exchange_is_accepted_as_openai_sends_it() -> None:
    req = request(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                  parallel_tool_calls=False,
                  messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert [t.function.name for t in req.tools or []] == ["get_weather", "add"]
    assert req.messages[1].tool_calls is not None and req.messages[2].tool_call_id == "call_1"
    assert req.uses_tools
    for choice in ("none", "auto", "required"):
        assert request(tools=[WEATHER], tool_choice=choice).tool_choice == choice
    assert not request(messages=[{"role": "assistant", "content": "hi", "tool_calls": []}, *USER]).uses_tools


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
     "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["x" * 40_000]}}}]},
     "tools.0.function.parameters"),
    ({"messages": [*USER, {"role": "tool", "content": "sunny"}]}, "messages.1"),
    ({"messages": [*USER, {"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.1"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}]},
     "messages.1.tool_calls.0.type"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refusal(**fields).param == param


def test_tools_past_their_bytes_together_are_refused_whatever_the_tool_choice() -> None:
    """128 tools of 32 KB each: every one within its own bounds, 4 MB together. With "none" they are never
    rendered or counted, so only this bound keeps them from being accepted for the price of "hi"."""
    props = {f"p{j:04d}": {"type": "string", "description": "d" * 8} for j in range(630)}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": props}}}
             for i in range(124)]
    for choice in ("none", "auto"):
        err = refusal(tools=tools, tool_choice=choice)
        assert err.param == "tools" and f"at most {MAX_TOOLS_BYTES}" in err.message
    fits = MAX_TOOLS_BYTES // len(json.dumps(tools[0], separators=(",", ":")))
    assert len(request(tools=tools[:fits], tool_choice="none").tools or []) == fits


def test_deep_parameters_are_refused_before_anything_walks_them() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH + 5):
        deep = {"type": "object", "properties": {"x": deep}}
    err = refusal(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])
    assert err.param == "tools.0.function.parameters" and "nested" in err.message


def test_tools_are_rendered_into_the_system_message_and_calls_and_results_as_text() -> None:
    req = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "windy"}])
    turns = render_messages(req)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in turns[0]["content"]
    assert "<tools>" in turns[0]["content"] and "<tool_call>" in turns[0]["content"]
    assert turns[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert turns[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    # tool_choice "none": no functions offered, the history still rendered
    none = render_messages(req.model_copy(update={"tool_choice": "none"}))
    assert "<tools>" not in none[0]["content"] and len(none) == 4
    # a named choice offers that function only
    add = {"type": "function", "function": {"name": "add"}}
    named = render_messages(request(tools=[WEATHER, ADD], tool_choice=add))
    assert named[0]["role"] == "system" and '"add"' in named[0]["content"] and "get_weather" not in named[0]["content"]


def test_consecutive_tool_results_are_joined_in_time_linear_in_their_text() -> None:
    """They share one user turn; each was added to it by copying the turn so far (2,047 results of 4,800 characters,
    a body the engine's 10 MB limit takes: 0.35 s of one worker holding the GIL, against 0.01 s as user turns)."""
    n, size = 2047, 4800

    def seconds_to_render(role: str) -> tuple[float, list[dict[str, str]]]:
        extra = {"tool_call_id": "call_1"} if role == "tool" else {}
        req = ChatCompletionRequest.model_construct(messages=[
            *(ChatMessage.model_construct(role=role, content="y" * size, name=None, tool_calls=None, **extra)
              for _ in range(n))], tools=None, tool_choice=None, parallel_tool_calls=None)
        start = time.perf_counter()
        turns = render_messages(req)
        return time.perf_counter() - start, turns

    # the best of three each: a pause of the machine (another test's process, a GC) lengthens one run, not all three
    as_users = min(seconds_to_render("user")[0] for _ in range(3))
    as_results = min(seconds_to_render("tool")[0] for _ in range(3))
    turns = seconds_to_render("tool")[1]
    assert turns == [{"role": "user", "content": "\n".join([f"<tool_response>\n{'y' * size}\n</tool_response>"] * n)}]
    assert as_results < 3 * as_users + 0.05, (as_results, as_users)


def test_free_answers_are_parsed_into_calls_and_what_is_not_one_stays_text() -> None:
    names = {"get_weather", "add"}
    content, calls = parse_answer('Let me see. <tool_call>\n{"name": "get_weather", "arguments": '
                                  '{"city": "Paris", "where": {"nested": {"deep": "}"}}}}\n</tool_call>', names)
    assert content == "Let me see." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "where": {"nested": {"deep": "}"}}}
    # a closing tag inside a string does not end the block; two blocks are two calls
    two = '<tool_call>{"name": "add", "arguments": {"a": "</tool_call>"}}</tool_call><tool_call>{"name": "add", ' \
          '"arguments": "{\\"a\\": 1}"}</tool_call>'
    content, calls = parse_answer(two, names)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"a": "</tool_call>"}, {"a": 1}]
    for bad in ('<tool_call>{"name": "add", "arguments": {"a": 1}', '<tool_call>{"name": "rm", "arguments": {}}'
                '</tool_call>', "<tool_call>not json</tool_call>", '<tool_call>{"name": "add", "arguments": [1]}'
                '</tool_call>', '<tool_call>' + "[" * 100_000 + '</tool_call>'):
        content, calls = parse_answer(bad, names)
        assert calls == [] and content == bad.strip()


def test_hostile_answers_are_parsed_in_bounded_work() -> None:
    """Huge arguments parse in one pass; at most MAX_BLOCKS_TRIED openings are parsed, the rest stays text."""
    huge = {"blob": "x" * 1_000_000, "nested": [[[{"k": "}]"}]]] * 1000}
    content, calls = parse_answer(f"<tool_call>{json.dumps({'name': 'add', 'arguments': huge})}</tool_call>", {"add"})
    assert content == "" and json.loads(calls[0].arguments) == huge
    block = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    content, calls = parse_answer(block * (MAX_BLOCKS_TRIED + 10), {"add"})
    assert len(calls) == MAX_BLOCKS_TRIED and content == block * 10
    junk = "<tool_call>{" * (MAX_BLOCKS_TRIED + 10)
    assert parse_answer(junk + block, {"add"}) == ((junk + block).strip(), [])  # the real one comes too late


def test_a_constrained_answer_has_a_schema_of_the_offered_functions() -> None:
    assert call_schema(request(tools=[WEATHER])) is None  # auto: free
    assert call_schema(request(tools=[WEATHER], tool_choice="none")) is None
    named = call_schema(request(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}))
    assert named is not None and named["properties"]["name"] == {"const": "add"}
    assert named["properties"]["arguments"] == ADD["function"]["parameters"]
    required = call_schema(request(tools=[WEATHER, ADD], tool_choice="required"))  # one call, of either
    assert required is not None and [c["properties"]["name"] for c in required["anyOf"]] == [
        {"const": "get_weather"}, {"const": "add"}]
    calls = parse_constrained('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', {"add"})
    assert calls is not None and calls[0].arguments == '{"a": 1, "b": 2}'
    assert parse_constrained('{"name": "add", "arguments": {"a": 1', {"add"}) is None  # cut by max_tokens
