"""A message's `name` at our engine's server (engine/server.py, wire/tool_calls.py's `named_roles`): honoured where
the model's chat template writes names into the prompt, a 400 naming `messages.<i>.name` where it does not (SmolLM2's
does not), never dropped so that alice and mallory read the same prompt.

Over real HTTP, with a scripted runner: one character tokenizer whose template writes role and content only (as
SmolLM2's), one whose template also writes names; and SmolLM2's own template, read from the prepared model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.fakes import CharTokenizer, ScriptedRunner, prompt_text
from tests.engine.test_prompt_special_tokens import serve

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


class NamingTokenizer(CharTokenizer):
    """A template that writes a user's or an assistant's name into its turn (`<user:alice>`), not a system's."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        def head(m: dict[str, str]) -> str:
            return f"{m['role']}:{m['name']}" if "name" in m and m["role"] != "system" else m["role"]

        return "".join(f"<{head(m)}>{m['content']}" for m in messages) + ">"


@pytest.fixture
def unnamed() -> Iterator[tuple[str, ScriptedRunner]]:
    yield from serve(CharTokenizer(), max_model_len=512)


@pytest.fixture
def naming() -> Iterator[tuple[str, ScriptedRunner]]:
    yield from serve(NamingTokenizer(), max_model_len=512)


def post(url: str, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": messages, **fields}, timeout=30)


def test_a_name_the_template_would_not_write_is_refused_by_name(unnamed: tuple[str, ScriptedRunner]) -> None:
    url, runner = unnamed
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "name": "alice", "content": "Who am I?"}]
    for stream in (False, True):  # refused before any byte of a stream
        r = post(url, messages, stream=stream)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == ("messages.1.name", "unsupported_parameter",
                                                                  "invalid_request_error")
    assert runner.order == []  # nothing was generated for it
    ok = post(url, [messages[0], {"role": "user", "content": "Who am I?"}])  # the same, unnamed: served
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hi."
    empty = post(url, [{"role": "user", "name": "", "content": "Who am I?"}])  # an empty name names nobody
    assert empty.status_code == 200


def test_a_name_the_template_writes_reaches_the_prompt(naming: tuple[str, ScriptedRunner]) -> None:
    url, runner = naming
    for name in ("alice", "mallory"):
        r = post(url, [{"role": "user", "name": name, "content": "Who am I?"}], max_tokens=2)
        assert r.status_code == 200, r.text
    prompts = [prompt_text(out.seqs[0]) for out in runner.steps if out.seqs]
    assert any("<user:alice>Who am I?" in p for p in prompts) and any("<user:mallory>Who am I?" in p for p in prompts)
    # this template writes no system message's name, and a tool result's turn is a user turn of results, where a
    # name would read as a user's: both refused, naming the message
    r = post(url, [{"role": "developer", "name": "ops", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.name"
    exchange = [{"role": "user", "name": "alice", "content": "Call f."},
                {"role": "assistant", "name": "bot", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "name": "f", "tool_call_id": "call_1", "content": "done"}]
    r = post(url, exchange)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.name"
    assert post(url, [*exchange[:2], {k: v for k, v in exchange[2].items() if k != "name"}]).status_code == 200


@pytest.mark.model
def test_smollm2s_template_writes_no_names(prepared_models: Path) -> None:
    from transformers import AutoTokenizer

    from wire.tool_calls import named_roles

    tokenizer = AutoTokenizer.from_pretrained(prepared_models / "smollm2-135m-instruct")
    assert named_roles(lambda turns: tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                                   tokenize=False)) == frozenset()
