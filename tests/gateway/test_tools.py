"""Tool calling through the gateway, with the official `openai` client.

With a stub upstream that records what it gets and answers tool calls: a remote tier gets `tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls` and `tool` messages exactly as they were sent, and its calls reach the
client whole and streamed (argument pieces that join into its arguments); a tier that cannot call tools is skipped
by `auto` and refused by name (400 naming `tools`); a tool_choice naming an unknown function is a 400 naming it,
before anything is routed; the cache never answers across different tools; tool definitions count in the prompt.
With `tiergate serve` on the real SmolLM2: "required" and named choices answer calls whose arguments validate, whole
and streamed, and the tool's result sent back gets a plain answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from gateway.ladder.apply import NORMAL
from gateway.pipeline.prompt import PromptStage
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_structured_output import client, served  # noqa: F401 (fixtures: the served gateway, its client)
from tests.stubs import ServerThread, StubState, health_routes, openai_tiers, write_settings
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "x-vendor": {"kept": [1, 2.5, None]}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
STUB_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
CALLED = {"role": "assistant", "content": None,  # one call, whose id is "c"
          "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
STUB_ANSWER = "It is sunny in Paris."

# what differs from tests/stubs.py's TIER_DEFAULTS: every tier is the stub
TIERS = {"small": {"tools": False, "price_per_1k_input": "0.0001", "price_per_1k_output": "0.0002",
                   "hardware_cost_per_hour": "0.01"},
         "mid": {},
         "full": {"price_per_1k_input": "0.003", "price_per_1k_output": "0.006", "hardware_cost_per_hour": "2"}}
PLANS = """
default_plan: standard
plans:
  standard:
    allowed_tiers: [small, mid, full]
    default_tier: small
  notools:
    allowed_tiers: [small]
    default_tier: small
"""


def tool_stub(state: StubState) -> Litestar:
    """An upstream that records each body and answers a call of get_weather when offered tools (in argument
    pieces, as OpenAI streams them), else STUB_ANSWER."""

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        body = json.loads(await request.body())
        state.requests.append(body)
        calls = body.get("tools") and body.get("tool_choice") != "none" and body["messages"][-1]["role"] != "tool"
        if calls:
            pieces = [STUB_ARGUMENTS[i:i + 7] for i in range(0, len(STUB_ARGUMENTS), 7)]
            deltas = [{"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": "call_stub", "type": "function",
                 "function": {"name": "get_weather", "arguments": ""}}]}]
            deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in pieces]
        else:
            deltas = [{"role": "assistant", "content": ""}, {"content": STUB_ANSWER}]
        return Stream(_sse(body["model"], deltas, "tool_calls" if calls else "stop"), media_type="text/event-stream")

    return Litestar([*health_routes(), chat])


async def _sse(model: str, deltas: list[dict[str, Any]], finish: str) -> AsyncIterator[bytes]:
    def event(data: dict[str, Any]) -> bytes:
        chunk = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": model, **data}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    for delta in deltas:
        yield event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await asyncio.sleep(0)
    yield event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    yield event({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": len(deltas),
                                          "total_tokens": 30 + len(deltas)}})
    yield b"data: [DONE]\n\n"


@pytest.fixture
def tool_gateway(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    state = StubState()
    with ServerThread(tool_stub(state)).start() as stub:
        settings = write_settings(tmp_path, prepared_models, openai_tiers(TIERS, url=stub.url), PLANS)
        with running_gateway(settings, state) as gw:
            yield gw


def openai_client(gw: Gateway, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key or gw.tenant_key, max_retries=0, timeout=60)


@pytest.fixture
def sdk(tool_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai_client(tool_gateway) as c:
        yield c


def test_a_remote_tier_gets_the_tool_fields_as_sent_and_its_calls_reach_the_client(tool_gateway: Gateway,
                                                                                  sdk: openai.OpenAI) -> None:
    sent = {"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False}
    chat = sdk.chat.completions
    answer = chat.create(model="mid", messages=USER, **sent)  # type: ignore[call-overload]
    got = tool_gateway.stub.requests[-1]
    assert {k: got[k] for k in sent} == sent  # verbatim: the vendor extension and its null kept
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
        ("call_stub", "get_weather", STUB_ARGUMENTS)]

    chunks = list(chat.create(model="mid", messages=USER, stream=True, **sent))  # type: ignore[call-overload]
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].id == "call_stub" and entries[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert len(entries) > 2 and "".join(e.function.arguments or "" for e in entries) == STUB_ARGUMENTS  # type: ignore
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the exchange goes back as sent, and the answer is plain
    call = choice.message.model_dump(exclude_none=True)
    messages = [*USER, call, {"role": "tool", "tool_call_id": "call_stub", "content": '{"sky": "clear"}'}]
    after = chat.create(model="mid", messages=messages, tools=[WEATHER, ADD])  # type: ignore[arg-type]
    assert after.choices[0].message.content == STUB_ANSWER and after.choices[0].finish_reason == "stop"
    assert tool_gateway.stub.requests[-1]["messages"][1:] == [
        {"role": "assistant", "tool_calls": call["tool_calls"]}, messages[2]]


def test_an_idempotent_retry_replays_the_tool_calls(tool_gateway: Gateway, sdk: openai.OpenAI) -> None:
    raw = sdk.chat.completions.with_raw_response
    sent: dict[str, Any] = {"model": "mid", "messages": USER, "tools": [WEATHER], "tool_choice": "required",
                            "extra_headers": {"Idempotency-Key": "weather-1"}}
    first = raw.create(**sent)
    again = raw.create(**sent)
    assert again.headers["x-tiergate-idempotent-replay"] == "true" and len(tool_gateway.stub.requests) == 1
    calls = [(c.id, c.function.name, c.function.arguments) for c in first.parse().choices[0].message.tool_calls or []]
    replayed = again.parse().choices[0]
    assert calls == [("call_stub", "get_weather", STUB_ARGUMENTS)] and replayed.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in replayed.message.tool_calls or []] == calls
    streamed = {**sent, "stream": True, "extra_headers": {"Idempotency-Key": "weather-2"}}
    for _ in range(2):  # answered, then replayed as a stream
        chunks = list(sdk.chat.completions.create(**streamed))
        entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
        assert entries[0].function.name == "get_weather"  # type: ignore[union-attr]
        assert "".join(e.function.arguments or "" for e in entries) == STUB_ARGUMENTS  # type: ignore[union-attr]
    assert len(tool_gateway.stub.requests) == 2


def test_auto_keeps_tool_requests_off_a_tier_that_cannot_call_tools(tool_gateway: Gateway, sdk: openai.OpenAI) -> None:
    raw = sdk.chat.completions.with_raw_response
    plain = raw.create(model="auto", messages=USER)
    assert plain.headers["x-tiergate-tier"] == "small"  # the plan's default
    with_tools = raw.create(model="auto", messages=USER, tools=[WEATHER])  # type: ignore[list-item]
    assert with_tools.headers["x-tiergate-tier"] == "mid"
    assert tool_gateway.stub.requests[-1]["model"] == "stub-mid"


def test_tool_requests_that_cannot_be_served_are_400s_naming_the_field(tool_gateway: Gateway) -> None:
    unknown = {"type": "function", "function": {"name": "launch"}}
    too_many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": "mid", "tools": [WEATHER], "tool_choice": unknown}, "tool_choice"),
        ({"model": "mid", "tool_choice": "required"}, "tool_choice"),
        ({"model": "mid", "tools": too_many}, "tools"),
        ({"model": "small", "tools": [WEATHER]}, "tools"),  # named, and it cannot
        ({"model": "small", "messages": [*USER, CALLED, {"role": "tool", "tool_call_id": "c", "content": "x"}]},
         "tools"),  # a tool exchange, even without tools
        ({"model": "mid", "tools": [WEATHER], "messages": [*USER, {"role": "assistant", "content": "x"},
                                                            {"role": "tool", "tool_call_id": "c", "content": "x"}]},
         "messages.2.tool_call_id"),  # a result after a message that made no call: OpenAI refuses it too
        ({"model": "mid", "tools": [WEATHER], "messages": [*USER, CALLED, {"role": "tool", "tool_call_id": "d",
                                                                           "content": "x"}]},
         "messages.2.tool_call_id"),  # an id the call before did not make
        ({"model": "mid", "tools": [WEATHER], "messages": [*USER, CALLED, *[{"role": "tool", "tool_call_id": "c",
                                                                             "content": "x"}] * 2]},
         "messages.3.tool_call_id"),  # answered twice
    ]
    with tool_gateway.client(tool_gateway.tenant_key) as c:
        for fields, param in cases:
            r = c.post("/v1/chat/completions", json={"messages": USER, **fields})
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
            if param.endswith("tool_call_id"):  # a result that answers no call: a code of its own, not null
                assert r.json()["error"]["code"] == "invalid_value", r.text
    assert tool_gateway.stub.requests == []  # nothing was routed
    assert all(row.price_usd == 0 for row in tool_gateway.ledger_rows())


def test_a_plan_whose_tiers_cannot_call_tools_is_refused_by_name(tool_gateway: Gateway) -> None:
    tool_gateway.store.create_tenant("plain", "notools")
    _, key = tool_gateway.store.issue_key("plain", name="test")
    with openai_client(tool_gateway, key) as c, pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="auto", messages=USER, tools=[WEATHER])  # type: ignore
    assert err.value.body["param"] == "tools"  # type: ignore[index]


def test_models_say_which_tiers_call_tools(sdk: openai.OpenAI) -> None:
    models = {m.id: m for m in sdk.models.list()}
    assert "tools" not in models["small"].model_extra["capabilities"]  # type: ignore[index]
    assert "tools" in models["mid"].model_extra["capabilities"] and "tools" in models["auto"].model_extra[  # type: ignore
        "capabilities"]


def test_the_cache_never_answers_across_tools(sdk: openai.OpenAI) -> None:
    raw = sdk.chat.completions.with_raw_response
    base: dict[str, Any] = {"model": "mid", "messages": USER, "temperature": 0}

    def cache(**fields: Any) -> str:
        return raw.create(**base, **fields).headers["x-tiergate-cache"]

    assert cache(tools=[WEATHER], tool_choice="none") == "miss"
    assert cache(tools=[WEATHER], tool_choice="none") == "hit"  # the same tools: the same answer
    assert cache() == "miss"  # without tools
    assert cache(tools=[ADD], tool_choice="none") == "miss"  # other tools
    assert cache(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False) == "miss"
    assert cache(tools=[WEATHER]) == "bypass"  # it may call a tool: never from the cache
    assert cache(tools=[WEATHER]) == "bypass"


async def test_tool_definitions_count_toward_the_prompt(prepared_models: Path) -> None:
    tier = TierSpec(backend="local", model="smollm2-135m-instruct", price_per_1k_input="0", price_per_1k_output="0",
                    hardware_cost_per_hour="0", context_limit=4096)
    stage = PromptStage(models_dir=prepared_models, default_max_tokens=64)

    async def count(**fields: Any) -> int:
        req = ChatCompletionRequest.model_validate({"model": "full", "messages": USER, **fields})
        return (await stage.measure(req, tier, NORMAL)).num_tokens

    plain, one, two = await count(), await count(tools=[WEATHER]), await count(tools=[WEATHER, ADD])
    assert plain + 100 < one < two  # each function's JSON, besides the instructions
    assert await count(tools=[WEATHER, ADD], tool_choice="none") == plain  # none offered, none rendered


# ---- the real model behind `tiergate serve` (the `full` tier; tests/gateway/test_structured_output.py's) ----


@pytest.mark.model
def test_a_local_tier_calls_tools_and_answers_their_results(client: openai.OpenAI) -> None:  # noqa: F811
    chat = client.chat.completions
    for choice, names in (("required", {"get_weather", "add"}),
                          ({"type": "function", "function": {"name": "add"}}, {"add"})):
        answer = chat.create(model="full", messages=USER, tools=[WEATHER, ADD], tool_choice=choice,  # type: ignore
                             temperature=0, max_tokens=80)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls" and message.tool_calls, answer
        for call in message.tool_calls:
            assert call.function.name in names  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore

    call = message.tool_calls[0]
    messages = [*USER, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"result": 5}'}]
    after = chat.create(model="full", messages=messages, tools=[WEATHER, ADD], temperature=0,  # type: ignore
                        max_tokens=40)
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content


@pytest.mark.model
def test_a_local_tier_streams_a_call_s_arguments_in_pieces(client: openai.OpenAI) -> None:  # noqa: F811
    chunks = list(client.chat.completions.create(
        model="full", messages=USER, tools=[WEATHER], tool_choice="required", temperature=0,  # type: ignore
        max_tokens=80, stream=True))
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].id and entries[0].function.name == "get_weather" and len(entries) > 2  # type: ignore
    jsonschema.validate(json.loads("".join(e.function.arguments or "" for e in entries)),  # type: ignore[union-attr]
                        SCHEMAS["get_weather"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_json_answers_tool_call_is_joined_in_time_linear_in_its_arguments() -> None:
    """The chat route's JSON answer joins each call's streamed argument pieces; appended to the string so far, each
    piece copied it (quadratic in a call whose length the tenant chooses, on the event loop)."""
    import time

    from gateway.pipeline.events import Delta, Done, Head
    from gateway.routes.chat import _whole

    def events(n: int, calls: bool) -> AsyncIterator[Any]:
        async def gen() -> AsyncIterator[Any]:
            for i in range(n):
                if calls:
                    fn = {"name": "f", "arguments": "abcd"} if i == 0 else {"arguments": "abcd"}
                    yield Delta("", None, [{"index": 0, **({"id": "call_1"} if i == 0 else {}), "function": fn}])
                else:
                    yield Delta("abcd", None)
            yield Done("tool_calls" if calls else "stop", 1, n)
        return gen()

    head = Head("chatcmpl-x", 0, "mid", {}, stream=False, include_usage=False)

    def timed(n: int, calls: bool) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        answer = asyncio.run(_whole(head, events(n, calls)))
        return time.perf_counter() - t0, answer

    n = 128_000
    timed(1000, True)  # warm
    # the best of three each: a pause of the machine (another test's process, a GC) lengthens one run, not all three
    as_text = min(timed(n, False)[0] for _ in range(3))
    as_calls = min(timed(n, True)[0] for _ in range(3))
    answer = timed(n, True)[1]
    call = answer["choices"][0]["message"]["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"] == {"name": "f", "arguments": "abcd" * n}
    assert as_calls < 3 * as_text + 0.05, (as_calls, as_text)


def test_a_json_answer_reads_an_upstream_entry_whose_function_is_no_object() -> None:
    """The meter keeps any entry with an int index; the JSON answer read `function` as an object and raised on a
    remote tier's `"function": "x"` (an AttributeError mid-answer). Both now read entries one way
    (gateway/pipeline/tool_call_pieces.py)."""
    from gateway.pipeline.events import Delta, Done, Head
    from gateway.routes.chat import _whole

    async def events() -> AsyncIterator[Any]:
        yield Delta("", None, [{"index": 0, "id": "call_1", "function": "x"}])
        yield Delta("", None, [{"index": 0, "function": {"name": "f", "arguments": "{}"}}])
        yield Done("tool_calls", 1, 2)

    head = Head("chatcmpl-x", 0, "mid", {}, stream=False, include_usage=False)
    call = asyncio.run(_whole(head, events()))["choices"][0]["message"]["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"] == {"name": "f", "arguments": "{}"}
