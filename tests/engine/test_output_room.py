"""A max_tokens that no prompt leaves room for (a prompt is at least one token: output plus one past the context, or
past the whole KV cache) is the context-length 400 at once: the prompt is neither rendered with the chat template nor
tokenized (engine/request_checks.py `check_output_room`, engine/server.py). One that leaves room for a prompt is
rendered, tokenized and checked as ever."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread

CONTEXT = 512
KV_TOKENS = 1024  # ScriptedRunner's 64 blocks of 16


class SpyTokenizer(CharTokenizer):
    """Counts what it is asked to tokenize and to render."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        self.calls.append("tokenize")
        return super().__call__(text, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        self.calls.append("render")
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def serve(max_model_len: int) -> Iterator[tuple[str, SpyTokenizer]]:
    tokenizer = SpyTokenizer()
    eng = LLMEngine(ScriptedRunner(max_model_len=max_model_len), tokenizer)
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        yield server.url, tokenizer
    finally:
        server.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, SpyTokenizer]]:
    yield from serve(CONTEXT)


def post(url: str, route: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", **({"messages": [{"role": "user", "content": "Hi"}]} if route == "chat/completions"
                                else {"prompt": "Hi"}), **fields}
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=30)


ROUTES = [("chat/completions", "messages"), ("completions", "prompt")]


CAPS = {"context": {"max_tokens": CONTEXT}, "past": {"max_tokens": CONTEXT + 1}, "huge": {"max_tokens": 2**31 - 1},
        "completion": {"max_completion_tokens": CONTEXT}}


@pytest.mark.parametrize(("route", "param", "cap"), [  # a text completion has max_tokens only
    pytest.param(route, param, cap, id=f"{route}-{name}") for route, param in ROUTES for name, cap in CAPS.items()
    if route == "chat/completions" or "max_completion_tokens" not in cap])
def test_max_tokens_that_leaves_no_room_for_a_prompt_is_refused_before_tokenizing(
        served: tuple[str, SpyTokenizer], route: str, param: str, cap: dict[str, int]) -> None:
    url, tokenizer = served
    tokenizer.calls.clear()
    r = post(url, route, **cap)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": param,
                                       "code": "context_length_exceeded"}
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert tokenizer.calls == []  # neither rendered nor tokenized


@pytest.mark.parametrize(("route", "param"), ROUTES)
def test_max_tokens_that_leaves_room_is_checked_against_the_prompt_as_before(
        served: tuple[str, SpyTokenizer], route: str, param: str) -> None:
    url, tokenizer = served
    tokenizer.calls.clear()
    r = post(url, route, max_tokens=CONTEXT - 1)  # room for a one-token prompt; this one is longer
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == param and "prompt tokens +" in r.json()["error"]["message"]
    assert "tokenize" in tokenizer.calls
    assert post(url, route, max_tokens=3).status_code == 200


@pytest.mark.parametrize(("route", "param"), ROUTES)
def test_max_tokens_past_the_kv_cache_is_refused_before_tokenizing(route: str, param: str) -> None:
    for url, tokenizer in serve(max_model_len=4 * KV_TOKENS):  # a context the KV cache cannot hold whole
        tokenizer.calls.clear()
        r = post(url, route, max_tokens=KV_TOKENS)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == param and f"KV cache holds {KV_TOKENS}" in r.json()["error"]["message"]
        assert tokenizer.calls == []
