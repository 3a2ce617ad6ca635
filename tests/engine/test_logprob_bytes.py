"""A chat answer's `logprobs` carry each token's own bytes, as OpenAI's do ("useful where characters are represented
by multiple tokens and their byte representations must be combined"): SmolLM2 spells an emoji or a CJK character in
tokens that each hold part of its UTF-8, which decode alone to U+FFFD; their `bytes` joined are the text's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.answer_frames import _logprobs
from engine.outputs import RequestOutput
from tests.engine.fakes import CharTokenizer


def _output(token_ids: list[int]) -> RequestOutput:
    top = [(i, -1.0) for i in token_ids[:2]]
    return RequestOutput("r", "", token_ids, True, "stop", 1, len(token_ids), 0.0,
                         logprobs=[(-0.5, top) for _ in token_ids])


@pytest.mark.parametrize("text", ["😀 hi", "日本語です", "café", "plain words"])
def test_the_tokens_bytes_joined_are_the_texts(prepared_models: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(prepared_models / "smollm2-135m-instruct")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    entries = _logprobs(tok, _output(ids))
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    for entry, token_id in zip(entries, ids, strict=True):
        assert entry["token"] == tok.decode([token_id])
        assert [t["bytes"] for t in entry["top_logprobs"]] == [e["bytes"] for e in entries[:2]]


def test_a_tokenizer_without_a_byte_vocabulary_gives_its_texts_bytes() -> None:
    entries = _logprobs(CharTokenizer(), _output([ord(c) for c in "Paris"]))
    assert [bytes(e["bytes"]) for e in entries] == [c.encode() for c in "Paris"]
