"""A legacy text completion's `logprobs.text_offset`: where each token starts in the prompt and completion, as OpenAI's
legacy API counts it. Text the engine holds back while it may still become a stop string (or an unfinished
character) is sent later, but its tokens still start where they start: each offset is the one before plus the
length of that token's text, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from engine.llm_engine import LLMEngine
from engine.server import create_engine_app
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread

PROMPT = "Q: "
# the scripted reply is "Paris is the capital."; "is x" is never met, but "is " is held until "t" rules it out
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "logprobs": 0, "stop": ["is x"]}


@pytest.fixture
def url() -> Iterator[str]:
    eng = LLMEngine(ScriptedRunner(max_model_len=512), CharTokenizer())
    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    yield server.url
    server.stop()
    eng.shutdown()


def _offsets_follow_the_tokens(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert "".join(tokens) == text == "Paris is the"
    starts = [len(PROMPT) + len("".join(tokens[:i])) for i in range(len(tokens))]
    assert offsets == starts


def test_whole(url: str) -> None:
    choice = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).json()["choices"][0]
    _offsets_follow_the_tokens(choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"])


def test_streamed(url: str) -> None:
    text, tokens, offsets = "", [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=BODY | {"stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    if choice["logprobs"]:
                        tokens += choice["logprobs"]["tokens"]
                        offsets += choice["logprobs"]["text_offset"]
    _offsets_follow_the_tokens(text, tokens, offsets)
