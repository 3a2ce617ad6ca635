"""Every parameter the engine's HTTP API takes is checked there again, whoever calls it: a remote engine is called by
another machine's gateway, or by anyone holding its key, not only through this gateway. A hostile value is a 400 in
OpenAI's shape naming the field, and nothing is generated (the scripted runner runs no step)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.engine.test_server import byte_level_tokenizer
from tests.stubs import ServerThread
from wire.errors import CACHE_SALT_HEADER

MSG = [{"role": "user", "content": "hi"}]
TOOL = '{"type": "function", "function": {"name": "f", "parameters": %s}}'
CHAT = {"model": "tiny", "messages": MSG, "max_tokens": 3}
TEXT = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


def serve(tokenizer: object) -> Iterator[tuple[str, LLMEngine, ScriptedRunner]]:
    runner = ScriptedRunner(reply='{"a": 1}', max_model_len=4096, num_kv_blocks=512)  # the tools' preamble is long
    eng = LLMEngine(runner, tokenizer)
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    yield server.url, eng, runner
    server.stop()
    eng.shutdown()


@pytest.fixture
def served() -> Iterator[tuple[str, LLMEngine, ScriptedRunner]]:
    yield from serve(CharTokenizer())


@pytest.fixture
def compiling() -> Iterator[tuple[str, LLMEngine, ScriptedRunner]]:
    """With a real (byte-level) tokenizer, so a response format is compiled by llguidance as on a model."""
    yield from serve(byte_level_tokenizer())


def post(url: str, path: str, body: dict[str, object], extra: str = "", headers: object = None) -> httpx.Response:
    """`body` with `extra` (raw JSON members: a literal json.dumps cannot write, such as 1e999) added."""
    raw = json.dumps(body)[:-1] + (", " + extra if extra else "") + "}"
    return httpx.post(f"{url}/v1/{path}", content=raw.encode(), headers=headers or {"content-type": "application/json"})


def refused(r: httpx.Response, param: str, runner: ScriptedRunner) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert not runner.steps  # nothing generated


SCHEMA = '{"type": "json_schema", "json_schema": {"name": "n", "schema": %s}}'


@pytest.mark.parametrize("schema", ['{"const": 1e999}', '{"type": "number", "maximum": -1e999}',
                                    '{"type": "array", "items": {"enum": [1, 1e400]}}'])
@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", TEXT)])
def test_a_schema_number_past_float64s_range_is_a_400_naming_the_schema(
        compiling: tuple[str, LLMEngine, ScriptedRunner], schema: str, path: str, body: dict[str, object]) -> None:
    """1e999 is JSON, read as infinity: llguidance got it as null, so `{"const": 1e999}` was answered (200) under
    `{"const": null}`, a schema other than the one sent."""
    url, eng, runner = compiling
    r = post(url, path, body, '"response_format": ' + SCHEMA % schema)
    refused(r, "response_format.json_schema.schema", runner)
    assert "1e999" in r.json()["error"]["message"] and eng.dead_reason is None


@pytest.mark.parametrize("choice", ['"auto"', '"required"'])
def test_a_tools_parameters_number_past_float64s_range_is_a_400_naming_them(
        compiling: tuple[str, LLMEngine, ScriptedRunner], choice: str) -> None:
    """Under "auto" the parameters were written into the prompt as `Infinity` and answered (200)."""
    url, _, runner = compiling
    tools = "[" + TOOL % '{"type": "object", "properties": {"a": {"type": "integer", "minimum": 1e999}}}' + "]"
    r = post(url, "chat/completions", CHAT, f'"tools": {tools}, "tool_choice": {choice}')
    refused(r, "tools.0.function.parameters", runner)


@pytest.mark.parametrize("salts", [["a", "b c"], ["t1", "t2"], ["t1", "t1"]])
@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", TEXT)])
def test_a_cache_salt_sent_more_than_once_is_a_400_naming_it(
        served: tuple[str, LLMEngine, ScriptedRunner], salts: list[str], path: str, body: dict[str, object]) -> None:
    """The first was used and the others never checked (a malformed second one too): whose prefix cache, and
    whose grammar and scheduling shares, the request took depended on the headers' order."""
    url, _, runner = served
    headers = [("content-type", "application/json"), *((CACHE_SALT_HEADER, s) for s in salts)]
    r = post(url, path, body, headers=headers)
    refused(r, CACHE_SALT_HEADER, runner)
    assert "sent 2 times" in r.json()["error"]["message"]
    assert post(url, path, body, headers=headers[:2]).status_code == 200  # one is served as before


@pytest.mark.parametrize(("field", "raw", "param"), [
    # the engine's own extensions (vLLM's): past their bounds, not integers, huge
    ("top_k", "-2", "top_k"), ("top_k", "2147483648", "top_k"), ("top_k", "1e999", "top_k"), ("top_k", "2.5", "top_k"),
    ("priority", "2147483648", "priority"), ("priority", "-2147483649", "priority"), ("priority", '"1"', "priority"),
    ("priority", "18446744073709551616", "priority"), ("priority", "true", "priority"),
    # floats past float64's range (read as infinity), and integers past every bound
    ("temperature", "1e999", "temperature"), ("top_p", "-1e999", "top_p"), ("presence_penalty", "1e999",
                                                                            "presence_penalty"),
    ("max_tokens", "18446744073709551616", "max_tokens"), ("max_tokens", "-1", "max_tokens"),
    ("seed", "1e999", "seed"), ("top_k", "-0.5", "top_k"),
    # unknown fields, nested ones too, refused by name
    ("ignore_eos", "true", "ignore_eos"), ("min_tokens", "1", "min_tokens"), ("guided_json", "{}", "guided_json"),
    ("stream_options", '{"include_usage": true, "x": 1}', "stream_options.x"),
    ("response_format", '{"type": "json_object", "schema": {}}', "response_format.schema"),
    # llguidance's compile options, which the engine's own overrode or took from the tenant
    ("response_format", '{"type": "json_schema", "json_schema": {"name": "n", "schema": {"x-guidance": '
                        '{"whitespace_flexible": true}}}}', "response_format.json_schema.schema.x-guidance"),
])
@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", TEXT)])
def test_a_hostile_value_of_a_field_both_endpoints_take_is_a_400_naming_it(
        served: tuple[str, LLMEngine, ScriptedRunner], field: str, raw: str, param: str, path: str,
        body: dict[str, object]) -> None:
    url, _, runner = served
    stream = ', "stream": true' if field == "stream_options" else ""
    refused(post(url, path, body, f'"{field}": {raw}{stream}'), param, runner)


@pytest.mark.parametrize("query", ["stream=true", "top_k=1&x=2", "api-version=2024-10-21", "user"])
@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", TEXT)])
def test_a_query_parameter_is_a_400_naming_it(served: tuple[str, LLMEngine, ScriptedRunner], query: str, path: str,
                                              body: dict[str, object]) -> None:
    """Litestar dropped it: `?stream=true` was answered whole, as the gateway refuses it (gateway/query_params.py)."""
    url, _, runner = served
    r = httpx.post(f"{url}/v1/{path}?{query}", json=body)
    refused(r, query.split("&")[0].split("=")[0], runner)
    assert r.json()["error"]["code"] == "unsupported_parameter"
    r = httpx.get(f"{url}/v1/models?{query}")
    assert r.status_code == 400 and r.json()["error"]["param"] == query.split("&")[0].split("=")[0]
    assert httpx.post(f"{url}/v1/{path}", json=body).status_code == 200  # without one, served as before
    assert httpx.get(f"{url}/v1/models").status_code == 200


def rendered(monkeypatch: pytest.MonkeyPatch, eng: LLMEngine) -> list[int]:
    """A list that grows by one each time the engine renders a conversation with its chat template (before
    tokenizing it)."""
    calls: list[int] = []
    render = eng.tokenizer.apply_chat_template

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return render(*args, **kwargs)

    monkeypatch.setattr(eng.tokenizer, "apply_chat_template", counted)
    return calls


def test_a_format_with_free_tool_calls_is_refused_before_the_prompt_is_rendered(
        served: tuple[str, LLMEngine, ScriptedRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal needs no prompt: it came after the conversation was rendered and tokenized (a long prompt cost a
    tokenizer thread up to a second for it), and the gateway relays it as the tenant's 400, billed nothing."""
    url, eng, runner = served
    calls = rendered(monkeypatch, eng)
    tools = "[" + TOOL % '{"type": "object"}' + "]"
    r = post(url, "chat/completions", CHAT, f'"tools": {tools}, "response_format": {{"type": "json_object"}}')
    refused(r, "response_format", runner)
    assert not calls
    assert post(url, "chat/completions", CHAT, f'"tools": {tools}').status_code == 200 and calls  # rendered then


def test_a_format_refused_to_the_tenant_before_is_refused_before_the_prompt_is_rendered(
        compiling: tuple[str, LLMEngine, ScriptedRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    url, eng, runner = compiling
    lookaround = '"response_format": ' + SCHEMA % '{"type": "string", "pattern": "(?=a)b"}'  # llguidance refuses it
    headers = {"content-type": "application/json", CACHE_SALT_HEADER: "t1"}
    refused(post(url, "chat/completions", CHAT, lookaround, headers=headers), "response_format", runner)
    calls = rendered(monkeypatch, eng)
    r = post(url, "chat/completions", CHAT, lookaround, headers=headers)  # remembered: refused at once
    refused(r, "response_format", runner)
    assert not calls and eng.grammars.num_compiles == 0
    assert post(url, "chat/completions", CHAT, headers=headers).status_code == 200 and calls


@pytest.mark.parametrize(("path", "body"), [("chat/completions", CHAT), ("completions", TEXT)])
def test_an_encoded_body_is_a_415_as_at_the_gateway(served: tuple[str, LLMEngine, ScriptedRunner], path: str,
                                                    body: dict[str, object]) -> None:
    """It was read as it came and refused as JSON that could not be parsed (400 invalid_json)."""
    url, _, runner = served
    raw = json.dumps(body).encode()
    r = httpx.post(f"{url}/v1/{path}", content=gzip.compress(raw),
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_encoding", r.text
    assert not runner.steps
    r = httpx.post(f"{url}/v1/{path}", content=raw, headers={"content-type": "application/json",
                                                             "content-encoding": "identity"})
    assert r.status_code == 200
