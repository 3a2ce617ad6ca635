"""Prompt counts by pieces (gateway/token_counter.py) equal the whole prompt's count, with the real SmolLM2
tokenizer, on prompts made to stress the cut: added tokens inside tenant text, half-written ones, spaces and
newlines at the pieces' edges, empty turns, non-Latin text. A tokenizer whose added tokens eat their neighbours'
spaces is counted whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from gateway.token_counter import TokenCounter, _added_token_cut
from tests.conftest import MODELS_DIR
from tests.gateway.test_token_counter_special_text import chatml_tokens

PIECES = ["alpha", " beta", "gamma ", "\n", "\n\n", "  ", "<|im_start|>", "<|im_end|>", "<|im_", "end|>",
          "<|endoftext|>", "<file_sep>", "42", "x²", "日本語", "über", "'s", "?", "\t", "<|im_start|>user\n",
          "emoji 🙂", ""]
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>")  # SmolLM2's, as PIECES may spell them


def text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))


@pytest.fixture
def fresh(prepared_models: Path) -> TokenCounter:
    return TokenCounter(MODELS_DIR / "smollm2-135m-instruct")  # not the shared one: nothing remembered yet


def test_a_prompt_counted_by_pieces_equals_its_whole_count(fresh: TokenCounter) -> None:
    assert fresh._cut is not None  # SmolLM2's tokenizer allows the cut
    rng = random.Random(11)
    for _ in range(400):
        messages = [{"role": rng.choice(["system", "user", "assistant"]), "content": text(rng)}
                    for _ in range(rng.randint(1, 4))]
        whole = len(fresh.tokenizer.encode(fresh.render(messages), add_special_tokens=False).ids)
        if any(special in m["content"] for m in messages for special in SPECIALS):  # as text, not tokens
            whole = chatml_tokens(messages)  # tests/gateway/test_token_counter_special_text.py
        assert fresh.prompt_tokens(messages) == whole, messages


def test_the_pieces_every_prompt_repeats_are_counted_once(fresh: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[str] = []
    real = fresh._piece_tokens
    monkeypatch.setattr(fresh, "_piece_tokens", lambda t: counted.append(t) or real(t))
    for i in range(3):
        fresh.prompt_tokens([{"role": "user", "content": f"question {i}"}])
    system = [t for t in counted if "You are a helpful AI assistant" in t]
    assert len(system) == 1  # the template's default system prompt, once
    assert sum("question" in t for t in counted) == 3  # each tenant text once


def test_added_tokens_that_eat_spaces_are_counted_whole() -> None:
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / "smollm2-135m-instruct" / "tokenizer.json"))
    assert _added_token_cut(tokenizer) is not None
    tokenizer.add_special_tokens([AddedToken("<pad_left>", lstrip=True)])
    assert _added_token_cut(tokenizer) is None
