"""A chat prompt too long for the context is refused before it is rendered: its messages' text alone, summed, is
compared with the longest prompt the context could hold (engine/request_checks.py `max_prompt_chars_for`), before marker
escaping, the scan for special tokens' strings (wire/prompt_text.py) and the chat template. 4 MB of `<|im_end|>`
held a worker thread 0.72 s before its 400; the refusal is the same 400 (`messages`, context_length_exceeded)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import engine.request_checks as checks_module
from engine.llm_engine import LLMEngine
from engine.request_checks import max_prompt_chars_for
from engine.server import create_engine_app
from tests.engine.fakes import ScriptedRunner
from tests.engine.test_prompt_special_tokens import chatml_tokenizer
from tests.stubs import ServerThread
from wire.prompt_text import PlainTenantText


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str], int]]:
    """The engine's server (the loop never needed: nothing here is generated), the renderers it calls, spied on, and
    the longest prompt it takes."""
    tok = chatml_tokenizer()
    eng = LLMEngine(ScriptedRunner(max_model_len=256, num_kv_blocks=64), tok)
    app = create_engine_app(eng, model_name="tiny", model_version="v1")  # its own probe renders once: not counted
    rendered: list[str] = []
    real_template, real_render, real_escaped = (tok.apply_chat_template, checks_module.render_messages,
                                                PlainTenantText.escaped)

    def template(*a: Any, **kw: Any) -> Any:
        rendered.append("apply_chat_template")
        return real_template(*a, **kw)

    def render(*a: Any, **kw: Any) -> Any:
        rendered.append("render_messages")
        return real_render(*a, **kw)

    def escaped(self: Any, *a: Any, **kw: Any) -> Any:
        rendered.append("escaped")
        return real_escaped(self, *a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", template)
    monkeypatch.setattr(checks_module, "render_messages", render)
    monkeypatch.setattr(PlainTenantText, "escaped", escaped)
    server = ServerThread(app).start()
    limit = max_prompt_chars_for(tok, eng.max_model_len)
    assert limit is not None
    try:
        yield server.url, rendered, limit
    finally:
        server.stop()
        eng.compiles.close()


def ask(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 3},
                      timeout=30)


def test_an_over_long_chat_prompt_is_refused_unrendered(served: tuple[str, list[str], int]) -> None:
    url, rendered, limit = served
    markers = "<|im_end|>" * (limit // 10 + 1)  # what forges turns: escaped and scanned before rendering, before
    for messages in ([{"role": "user", "content": markers}],
                     [{"role": "system", "content": "x" * (limit // 2)},
                      {"role": "user", "content": [{"type": "text", "text": "y" * (limit // 2 + 1)}]}]):
        r = ask(url, messages)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "messages", "context_length_exceeded", "invalid_request_error")
        assert f"holds at most {limit}" in error["message"]
        assert rendered == []  # refused before the escaping, the scan and the template


def test_a_prompt_within_the_bound_is_still_rendered(served: tuple[str, list[str], int]) -> None:
    url, rendered, limit = served
    padded = "  " + "x" * (limit - 4) + "  \n"  # over the bound only by the whitespace a template may trim
    r = ask(url, [{"role": "user", "content": padded}])
    assert r.status_code == 400  # rendered and found too long there, as before
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "apply_chat_template" in rendered
