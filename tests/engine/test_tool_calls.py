"""Tool calls in our engine's answers (engine/tool_calls.py): the grammar that forces a call, and the answer shaped
into OpenAI's `tool_calls`, whole and streamed.

Without a model: a constrained answer streamed in pieces cut anywhere gives a call's first delta (index, id, type,
name, empty arguments) and argument pieces that join into the arguments; a free answer streams its text and holds a
`<tool_call>` block until it ends; a block that does not parse is content. On the real SmolLM2 behind the engine's
server, with the official client: "required" and named choices answer calls whose arguments validate, streamed too,
and a tool result sent back gets a plain answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.sampling_params import EngineInputError
from engine.tool_calls import MAX_CALL_SCHEMA_BYTES, ToolAnswer, answer_format
from wire.chat_request import ChatCompletionRequest
from wire.tool_calls import parse_answer
from wire.tools import Tool

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": [WEATHER, ADD], **fields})


def stream(answer: ToolAnswer, text: str, cuts: list[int], reason: str = "stop") -> tuple[list[dict[str, Any]], str]:
    deltas: list[dict[str, Any]] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += answer.feed(text[a:b])
    tail, finish = answer.finish(reason)
    return deltas + tail, str(finish)


def joined(deltas: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """The calls the deltas make, as a client joins them."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] += entry.get("id", "")
            call["name"] += entry.get("function", {}).get("name", "")
            call["arguments"] += entry["function"].get("arguments", "")
    return calls


def test_a_constrained_answer_streams_its_arguments_however_the_text_is_cut() -> None:
    text = ('[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}]", "unit": "celsius"}}, '
            '{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    for step in (1, 2, 3, 7, len(text)):
        answer = ToolAnswer(request(tool_choice="required"))
        deltas, finish = stream(answer, text, list(range(step, len(text), step)))
        calls = joined(deltas)
        assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather", "add"]
        assert json.loads(calls[0]["arguments"]) == {"city": 'Pa"ris}]', "unit": "celsius"}
        assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 2}
        first = next(d["tool_calls"][0] for d in deltas)  # as OpenAI: the first delta names the call
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": "get_weather", "arguments": ""}
        assert not any("content" in d for d in deltas)


def test_a_constrained_answer_whole_and_cut_short() -> None:
    answer = ToolAnswer(request(tool_choice={"type": "function", "function": {"name": "add"}}))
    content, calls, finish = answer.whole('{"name": "add", "arguments": {"a": 1, "b": 2}}', "stop")
    assert content is None and finish == "tool_calls" and calls is not None
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    cut = '{"name": "add", "arguments": {"a": 1'
    assert answer.whole(cut, "length") == (cut, None, "length")  # as far as it went, and why it stopped


def test_a_free_answer_streams_text_and_holds_a_call_until_it_ends() -> None:
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' \
           '</tool_call>'
    answer = ToolAnswer(request())
    deltas, finish = stream(answer, text, list(range(1, len(text))))
    sent = "".join(d.get("content", "") for d in deltas)
    assert sent.strip() == "Checking." and finish == "tool_calls"
    assert json.loads(joined(deltas)[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    # text that only looks like an opening is sent once it cannot be one; a broken block is content
    for plain in ("a <tool b", "<tool_call>{not json}</tool_call>", "<tool_call>{\"name\": \"rm\", \"arguments\": {}}"):
        deltas, finish = stream(ToolAnswer(request()), plain, list(range(1, len(plain))))
        assert "".join(d.get("content", "") for d in deltas) == plain and finish == "stop"
        assert ToolAnswer(request()).whole(plain, "stop") == (plain, None, "stop")


def test_tool_choice_none_leaves_the_answer_alone_and_the_format_follows_the_choice() -> None:
    assert ToolAnswer.for_request(request(tool_choice="none")) is None
    assert answer_format(request()) is None and answer_format(request(tool_choice="none")) is None
    fmt = answer_format(request(tool_choice="required"))
    assert fmt is not None and fmt.json_schema is not None and len(fmt.json_schema.schema_["anyOf"]) == 2
    with pytest.raises(EngineInputError) as err:  # a JSON-only answer could never call a tool
        answer_format(request(response_format={"type": "json_object"}))
    assert err.value.param == "response_format"
    big = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"enum": ["x" * 30_000]}}}
           for i in range(MAX_CALL_SCHEMA_BYTES // 30_000 + 1)]
    # past the wire's bound on tools together (wire/tools.py), so built around it: the engine checks again
    past_wire = request(tool_choice="required").model_copy(update={"tools": [Tool.model_validate(t) for t in big]})
    with pytest.raises(EngineInputError) as err:
        answer_format(past_wire)
    assert err.value.param == "tools"


async def test_the_engine_streams_a_call_whose_last_piece_ends_the_answer() -> None:
    """The engine's stream framing: the output that finishes the answer also carries its last text."""
    from engine.answer_frames import chat_frames, sse_events
    from engine.llm_engine import RequestOutput

    texts = ['Sure. <tool_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}', "</tool_call>"]

    async def outputs() -> Any:
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield RequestOutput("r", text, [i], last, "stop" if last else None, 5, i + 1, 0.0)

    events = [e async for e in sse_events(outputs(), "r", "m", False, False, chat_frames(None, ToolAnswer(request())))]
    chunks = [json.loads(e[6:]) for e in events if e != b"data: [DONE]\n\n"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Sure."
    assert json.loads(joined(deltas)[0]["arguments"]) == {"a": 1, "b": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("continuous_usage", [False, True])
@pytest.mark.parametrize("texts", [["Hi", " there", " x<"], ["Hi", " a", " b<tool_call>c"], ["Hi", " <", "tool"],
                                   ["Hi", " a<", "<"]])
async def test_text_held_back_to_the_end_of_an_answer_at_its_cap_reaches_the_client(texts: list[str],
                                                                                    continuous_usage: bool) -> None:
    """An answer cut at max_tokens whose last characters were held back (a possible `<tool_call>`, a block that did not
    become a call) sends them with its last token's text: in a chunk of their own they read as one token more than
    max_tokens, and the gateway's meter ended the answer before them (the client lost them)."""
    from engine.answer_frames import chat_frames, sse_events
    from engine.llm_engine import RequestOutput
    from gateway.pipeline.meter import Meter

    async def outputs() -> Any:
        for i, text in enumerate(texts):  # a token each, the last one at the cap
            last = i == len(texts) - 1
            yield RequestOutput("r", text, [i], last, "length" if last else None, 5, i + 1, 0.0)

    frames = chat_frames(None, ToolAnswer(request()))
    events = [e async for e in sse_events(outputs(), "r", "m", True, continuous_usage, frames)]
    meter = Meter(0.0, counted_input=5, output_cap=len(texts))
    for event in events[:-1]:
        meter.add(json.loads(event[6:]))
        assert not meter.overran, events
    assert events[-1] == b"data: [DONE]\n\n"
    outcome = meter.outcome("ok", 200)
    assert (outcome.text, outcome.finish_reason, outcome.output_tokens) == ("".join(texts), "length", len(texts))


# ---- parallel_tool_calls: false (at most one call per answer) ----

TWO_CALLS = ('Checking. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\nAnd then '
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
             ' done')


def test_a_free_answer_without_parallel_calls_ends_at_its_first_call() -> None:
    """OpenAI's `parallel_tool_calls: false`: one call at most; a call ends the turn, so the text after it (a second
    call's block, prose) is no part of the answer: neither a call nor content. Whole and streamed, cut anywhere."""
    assert len(ToolAnswer(request()).whole(TWO_CALLS, "stop")[1] or []) == 2  # allowed by default
    assert len(ToolAnswer(request(parallel_tool_calls=True)).whole(TWO_CALLS, "stop")[1] or []) == 2
    single = request(parallel_tool_calls=False)
    content, calls, finish = ToolAnswer(single).whole(TWO_CALLS, "stop")
    assert content == "Checking." and finish == "tool_calls" and calls is not None
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    for step in (1, 5, len(TWO_CALLS)):
        deltas, finish = stream(ToolAnswer(single), TWO_CALLS, list(range(step, len(TWO_CALLS), step)))
        assert "".join(d.get("content", "") for d in deltas).strip() == "Checking." and finish == "tool_calls"
        assert {i: (c["name"], json.loads(c["arguments"])) for i, c in joined(deltas).items()} == {
            0: ("add", {"a": 1, "b": 2})}
    # max_tokens cut the text after the one call: the answer had ended there, with its call
    cut = TWO_CALLS[:TWO_CALLS.index("And then") + 12]
    assert ToolAnswer(single).whole(cut, "length")[2] == "tool_calls"
    assert stream(ToolAnswer(single), cut, [7, 30], "length")[1] == "tool_calls"
    assert ToolAnswer(request()).whole(cut, "length")[2] == "length"  # parallel calls: the answer was cut
    # a block that is no call stays text, and the first real call after it is the one
    broken = '<tool_call>{"name": "rm", "arguments": {}}</tool_call> ' + TWO_CALLS
    content, calls, _ = ToolAnswer(single).whole(broken, "stop")
    assert calls is not None and [c["function"]["name"] for c in calls] == ["add"]
    assert content == '<tool_call>{"name": "rm", "arguments": {}}</tool_call> Checking.'


FREE_ANSWERS = [TWO_CALLS, "plain text, then <tool b", "a <tool_call>{not json}</tool_call> b", TWO_CALLS[:60],
                '<tool_call>{"name": "rm", "arguments": {}}</tool_call> ' + TWO_CALLS,
                "<tool_call><tool_call>" + TWO_CALLS]
STEPS = (1, 2, 3, 7, 11, 1000)  # the characters of each piece fed; 1000: the answer in one


def test_a_free_answer_fed_in_pieces_of_any_size_is_the_answer_in_one_piece() -> None:
    """A held block is kept as its pieces and joined once, when the answer ends: the same content, calls and finish
    reason whatever the pieces' sizes, and the calls those of the whole answer."""
    for parallel in (True, False):
        req = request(parallel_tool_calls=parallel)
        for text in FREE_ANSWERS:
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ToolAnswer(req).whole(text, "stop")[1]
                     or []]
            shaped = set()
            for step in STEPS:
                deltas, finish = stream(ToolAnswer(req), text, list(range(step, len(text), step)))
                assert [(c["name"], c["arguments"]) for c in joined(deltas).values()] == calls, (parallel, text, step)
                shaped.add(("".join(d.get("content", "") for d in deltas), finish))
            assert len(shaped) == 1, (parallel, text, shaped)


async def test_one_call_ends_at_the_output_that_makes_the_first_call_whole_whatever_the_outputs() -> None:
    """`one_call` looks for the opening in each output's new text (it may straddle two): the answer ends at the same
    place for outputs of any size, the output that brings the first call's `</tool_call>`."""
    from engine.llm_engine import RequestOutput
    from engine.tool_calls import one_call

    req = request(parallel_tool_calls=False)
    for text in FREE_ANSWERS:
        _, calls = parse_answer(text, {"add", "get_weather"}, parallel=False)
        first = text.index("</tool_call>", text.index(calls[0].arguments)) + len("</tool_call>") if calls else None
        for step in STEPS:
            pieces = [text[a:a + step] for a in range(0, len(text), step)]

            async def outputs(pieces: list[str] = pieces) -> Any:
                for i, piece in enumerate(pieces):
                    last = i == len(pieces) - 1
                    yield RequestOutput("r", piece, [i], last, "length" if last else None, 5, i + 1, 0.0)

            made = [out async for out in one_call(outputs(), req)]
            end = len(text) if first is None else min(len(text), -(-first // step) * step)
            assert "".join(out.text for out in made) == text[:end], (text, step)
            # cut before the last output: "stop"; the last one is the engine's own end
            assert made[-1].finished and made[-1].finish_reason == ("stop" if end < len(text) else "length")


def test_a_constrained_answer_without_parallel_calls_has_one_call() -> None:
    """The grammar asks for one call object (`call_schema`); past it nothing is read, whole or streamed."""
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "P"}}]'
    single = request(tool_choice="required", parallel_tool_calls=False)
    assert answer_format(single) == answer_format(request(tool_choice="required"))  # one object either way
    content, calls, finish = ToolAnswer(single).whole(text, "stop")
    assert content is None and finish == "tool_calls" and calls is not None
    assert [c["function"]["name"] for c in calls] == ["add"]
    for step in (1, 3, len(text)):
        deltas, finish = stream(ToolAnswer(single), text, list(range(step, len(text), step)))
        assert finish == "tool_calls" and list(joined(deltas)) == [0]
        assert json.loads(joined(deltas)[0]["arguments"]) == {"a": 1, "b": 2}
    lost = ToolAnswer(single)  # a shape the scan does not follow: the calls sent whole at the end, the first only
    deltas, finish = stream(lost, "[" + " " * 200 + text[1:], [])
    assert list(joined(deltas)) == [0] and finish == "tool_calls"


def test_the_engine_answers_one_call_without_parallel_calls_over_http() -> None:
    """The engine's server, a scripted model writing two calls: one call, whole and streamed."""
    import httpx

    from engine.llm_engine import LLMEngine
    from engine.server import create_engine_app
    from tests.engine.fakes import CharTokenizer, ScriptedRunner
    from tests.stubs import ServerThread

    compact = TWO_CALLS.replace("\n", "")
    eng = LLMEngine(ScriptedRunner(reply=compact, max_model_len=2048, num_kv_blocks=128), CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="m", model_version="v")).start()
    body = {"model": "m", "messages": USER, "tools": [WEATHER, ADD], "parallel_tool_calls": False, "max_tokens": 400}
    try:
        whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        both = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "parallel_tool_calls": True},
                          timeout=30).json()["choices"][0]
    finally:
        server.stop()
        eng.shutdown()
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Checking."
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["add"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert list(joined(deltas)) == [0] and joined(deltas)[0]["name"] == "add"
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Checking."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert [c["function"]["name"] for c in both["message"]["tool_calls"]] == ["add", "get_weather"]


# ---- the real model behind the engine's server ----


@pytest.fixture(scope="module")
def engine_url(prepared_models: Path) -> Iterator[str]:
    import torch
    from transformers import AutoTokenizer

    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.server import create_engine_app
    from tests.stubs import ServerThread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two cores stall whenever another process runs there
    model = prepared_models / "smollm2-135m-instruct"
    engine = LLMEngine(ModelRunner(model, dtype="fp32", kv_cache_bytes=64 << 20), AutoTokenizer.from_pretrained(model),
                       max_num_seqs=4, max_num_batched_tokens=512)
    engine.start()
    server = ServerThread(create_engine_app(engine, model_name="m", model_version="v")).start()
    try:
        yield server.url
    finally:
        server.stop()
        engine.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.model
def test_the_engine_answers_required_and_named_choices_with_valid_calls(engine_url: str) -> None:
    import openai

    with openai.OpenAI(base_url=f"{engine_url}/v1", api_key="none", max_retries=0, timeout=300) as client:
        for choice, names in (("required", {"get_weather", "add"}), ({"type": "function", "function": {"name": "add"}},
                                                                    {"add"})):
            answer = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER, ADD],  # type: ignore
                                                    tool_choice=choice, temperature=0, max_tokens=80)  # type: ignore
            choice0 = answer.choices[0]
            assert choice0.finish_reason == "tool_calls" and choice0.message.tool_calls, choice0
            for call in choice0.message.tool_calls:
                assert call.function.name in names and call.id.startswith("call_")  # type: ignore[union-attr]
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore

        chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], tool_choice="required",
                                                     temperature=0, max_tokens=80, stream=True))  # type: ignore
        entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
        assert entries[0].id and entries[0].function.name == "get_weather" and len(entries) > 2  # streamed in pieces
        arguments = "".join(e.function.arguments or "" for e in entries if e.index == 0)  # type: ignore[union-attr]
        jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_without_parallel_calls_generation_stops_at_the_first_whole_call() -> None:
    """What the model would write after its one call is dropped, so it is not made, nor billed: the engine stops
    the generation at the token that closes the first call, whole and streamed (usage counts the tokens made)."""
    import httpx

    from engine.llm_engine import LLMEngine
    from engine.server import create_engine_app
    from tests.engine.fakes import CharTokenizer, ScriptedRunner
    from tests.stubs import ServerThread

    compact = TWO_CALLS.replace("\n", "")
    first_call = compact.index("</tool_call>") + len("</tool_call>")  # one token a character
    eng = LLMEngine(ScriptedRunner(reply=compact, max_model_len=2048, num_kv_blocks=128), CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="m", model_version="v")).start()
    body = {"model": "m", "messages": USER, "tools": [WEATHER, ADD], "parallel_tool_calls": False, "max_tokens": 400}
    try:
        whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        both = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "parallel_tool_calls": True},
                          timeout=30).json()
        assert eng.stats().num_running == 0  # the stopped generations freed their slots
    finally:
        server.stop()
        eng.shutdown()
    assert whole["usage"]["completion_tokens"] == first_call
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]] == ["add"]
    assert chunks[-1]["usage"]["completion_tokens"] == first_call
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert list(joined(deltas)) == [0] and joined(deltas)[0]["name"] == "add"
    assert both["usage"]["completion_tokens"] == len(compact) + 1  # several calls allowed: all of it, and its end
