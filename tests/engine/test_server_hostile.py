"""The engine's server holds whatever a tenant sends it or steers the model into: each case here was a 500 (or a
stream cut mid-answer, or a normal request held behind a hostile one) found by sending requests straight to an engine
on SmolLM2, which an echo prompt makes write what it is told. Every engine 500 counts against the replica's breaker,
whoever caused it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import engine.answer_frames
from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from engine.tool_calls import ToolAnswer
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.engine.test_server import byte_level_tokenizer
from tests.stubs import ServerThread
from wire.chat_request import ChatCompletionRequest

MSG = [{"role": "user", "content": "echo"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
LIST_NAME = '<tool_call>{"name": ["f"], "arguments": {}}</tool_call>'
OBJECT_NAME = '<tool_call>{"name": {"f": 1}, "arguments": {}}</tool_call>'
SURROGATE_ARGS = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'  # JSON text: a \ud800 escape


def serve(reply: str, tokenizer: Any = None) -> tuple[ServerThread, LLMEngine, ScriptedRunner]:
    runner = ScriptedRunner(reply=reply, max_model_len=4096, num_kv_blocks=512)  # the tools' preamble is long
    eng = LLMEngine(runner, tokenizer or CharTokenizer())
    eng.start()
    return ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start(), eng, runner


@pytest.fixture
def echo(request: pytest.FixtureRequest) -> Iterator[tuple[str, LLMEngine, ScriptedRunner]]:
    server, eng, runner = serve(request.param)
    yield server.url, eng, runner
    server.stop()
    eng.shutdown()


def stream_events(url: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def still_serves(url: str, eng: LLMEngine) -> None:
    assert httpx.get(f"{url}/health").json()["status"] == "ok" and eng.dead_reason is None
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 3})
    assert r.status_code == 200


@pytest.mark.parametrize("echo", [LIST_NAME, OBJECT_NAME], indirect=True)
def test_a_tool_call_whose_name_is_not_a_string_is_text_not_a_500(echo: tuple[str, LLMEngine, ScriptedRunner],
                                                                    ) -> None:
    url, eng, runner = echo
    reply = "".join(map(chr, runner.reply[:-1]))
    body = {"model": "tiny", "messages": MSG, "tools": TOOLS, "max_tokens": 200}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text  # was 500: `["f"] in set` raised TypeError while parsing the answer
    message = r.json()["choices"][0]["message"]
    assert message["content"] == reply and message.get("tool_calls") is None
    events = stream_events(url, body)  # was a connection cut with no [DONE]
    assert not any("error" in e for e in events)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == reply
    still_serves(url, eng)


@pytest.mark.parametrize("echo", [SURROGATE_ARGS], indirect=True)
def test_tool_call_arguments_that_spell_a_lone_surrogate_are_sent_escaped(
        echo: tuple[str, LLMEngine, ScriptedRunner]) -> None:
    url, eng, _ = echo
    body = {"model": "tiny", "messages": MSG, "tools": TOOLS, "max_tokens": 200}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text  # was 500: "Unable to serialize response content" (a lone surrogate)
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "f" and json.loads(call["arguments"]) == {"a": "\ud800"}  # what the model wrote
    events = stream_events(url, body)
    assert not any("error" in e for e in events)
    args = "".join(tc["function"].get("arguments", "") for e in events for c in e["choices"]
                   for tc in c["delta"].get("tool_calls") or [])
    assert json.loads(args) == {"a": "\ud800"}
    still_serves(url, eng)


def test_a_constrained_answer_with_a_lone_surrogate_encodes() -> None:
    """tool_choice "required": the grammar lets a string hold any JSON escape, \\ud800 too."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "tools": TOOLS,
                                                "tool_choice": "required"})
    content, calls, reason = ToolAnswer(req).whole('{"name": "f", "arguments": {"a": "\\udfff"}}', "stop")
    assert content is None and reason == "tool_calls" and calls is not None
    arguments = calls[0]["function"]["arguments"]
    arguments.encode()  # raised UnicodeEncodeError when the response was encoded
    assert json.loads(arguments) == {"a": "\udfff"}
    # a list of calls whose name is a list is no call, not a TypeError
    assert ToolAnswer(req).whole('[{"name": ["f"], "arguments": {}}]', "stop")[1] is None


def test_a_past_call_whose_arguments_spell_a_lone_surrogate_is_rendered_escaped() -> None:
    """An assistant's earlier call whose arguments are JSON with a \\ud800 escape rendered (wire/tool_calls.py) as
    text holding the surrogate itself, which the real tokenizer refused with TypeError: a 500. It is now rendered
    with the escape kept, and served."""
    server, eng, _ = serve("ok", byte_level_tokenizer())
    try:
        history = [*MSG, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": '{"a": "\\ud800"}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": history})
        assert r.status_code == 200, r.text
        still_serves(server.url, eng)
    finally:
        server.stop()
        eng.shutdown()


def test_a_conversation_the_chat_template_refuses_is_a_400_naming_messages() -> None:
    """Templates of other models refuse some conversations (`raise_exception`: roles must alternate, ...)."""
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = ("{% if messages[0].role != 'user' %}{{ raise_exception('the first turn must be the "
                               "user') }}{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>")
    server, eng, _ = serve("ok", tokenizer)
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "assistant", "content": "x"}, *MSG]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "first turn must be the user" in error["message"]
        still_serves(server.url, eng)
    finally:
        server.stop()
        eng.shutdown()


@pytest.mark.parametrize("echo", ["x" * 300], indirect=True)
def test_a_failure_framing_an_answer_is_an_openai_500_or_the_streams_last_event(
        echo: tuple[str, LLMEngine, ScriptedRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug (not the request) while an answer is framed: OpenAI's error shape, the stream ends with an error event
    and [DONE] (it was cut mid-answer), and the request's generation stops (slot and KV blocks back)."""
    url, eng, runner = echo
    runner.step_s = 0.01

    def broken(*_: Any) -> None:
        raise RuntimeError("a framing bug")

    monkeypatch.setattr(engine.answer_frames, "_logprobs", broken)
    body = {"model": "tiny", "messages": MSG, "logprobs": True, "max_tokens": 400}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    assert "framing bug" not in r.text  # no internals
    events = stream_events(url, body)
    assert events[-1]["error"]["code"] == "engine_error"
    deadline = time.time() + 2  # an abort takes effect within a step; run on, each answer takes 3 s
    while time.time() < deadline and eng.stats().num_running:
        time.sleep(0.01)
    stats = eng.stats()
    assert stats.num_running == 0 and stats.num_kv_blocks_used == 0 and len(runner.released) == 2
    assert stats.num_generation_tokens_total < 100  # both stopped early (run on: 2 x 301)
    monkeypatch.undo()
    still_serves(url, eng)




class LongestTokenTokenizer(CharTokenizer):
    """A token per character, but one per 10 for runs of "x", with a 100-character vocabulary entry (the longest-token
    bound lets 100 characters per context token through, as SmolLM2's 81-character entry does); records the length
    of each text it tokenizes."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def get_vocab(self) -> dict[str, int]:
        return super().get_vocab() | {"x" * 100: 127}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.lengths.append(len(text))
        return {"input_ids": [ord(c) for i, c in enumerate(text) if c != "x" or i % 10 == 0]}


@pytest.mark.parametrize("text", ["y" * (50 * 4096),  # 50 times the context, under the longest-token bound
                                  "x" * 32_768 + "y" * 150_000])  # a first piece that fits, then dense text
def test_a_prompt_far_past_the_context_is_refused_in_pieces_not_tokenized_whole(text: str) -> None:
    tokenizer = LongestTokenTokenizer()
    server, eng, _ = serve("ok", tokenizer)  # max_model_len 4096: pieces of 32,768 characters
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "prompt"
        assert max(tokenizer.lengths) <= 8 * 4096 and sum(tokenizer.lengths) <= 2 * 8 * 4096  # was the whole text
        still_serves(server.url, eng)
    finally:
        server.stop()
        eng.shutdown()


def test_a_prompt_longer_than_a_piece_that_fits_is_served() -> None:
    tokenizer = LongestTokenTokenizer()
    server, eng, _ = serve("ok", tokenizer)
    try:
        text = "x" * 38_000  # past the 32,768-character piece; 3,800 tokens
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": text, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3_800
        assert tokenizer.lengths[-1] == 38_000
    finally:
        server.stop()
        eng.shutdown()
