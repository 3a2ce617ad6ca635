"""A body whose JSON spells half of a UTF-16 surrogate pair (`"\\ud83d"`: a string cut inside an emoji, as a client
slicing UTF-16 makes) is not text and is refused, 400 `invalid_json`; the refusal says so and where, not that the
body was truncated (msgspec's words for a lone high surrogate). An escaped backslash before `u` is text, and a
whole pair is the character it spells."""

from __future__ import annotations

import pytest

from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.embeddings import EmbeddingRequest
from wire.validation import BodyError, parse_body

BODIES = {
    ChatCompletionRequest: b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}',
    CompletionRequest: b'{"model": "m", "prompt": "%s"}',
    EmbeddingRequest: b'{"model": "m", "input": ["ok", "%s"]}',
}


@pytest.mark.parametrize("model", list(BODIES), ids=lambda m: m.__name__)
@pytest.mark.parametrize(("text", "alone"), [
    (rb"smile \ud83d", rb"\ud83d"),
    (rb"\ud83d\ud83d\ude00", rb"\ud83d"),  # the first is alone; the second has its pair
    (rb"\\\ud800 after an escaped backslash", rb"\ud800"),
    (rb"\udc00 alone", rb"\udc00"),
], ids=["cut", "high-twice", "after-backslash", "low"])
def test_half_a_pair_is_refused_as_such(model: type, text: bytes, alone: bytes) -> None:
    body = BODIES[model] % text
    with pytest.raises(BodyError) as refused:
        parse_body(body, model)
    err = refused.value
    assert err.code == "invalid_json" and err.param is None
    assert "surrogate" in err.message and "truncated" not in err.message, err.message
    assert f"byte {body.index(alone)}" in err.message, err.message


@pytest.mark.parametrize(("text", "read"), [(rb"\\ud83d", "\\ud83d"), (rb"\ud83d\ude00", "\U0001f600")],
                         ids=["escaped-backslash", "pair"])
def test_text_that_only_looks_like_it_is_read(text: bytes, read: str) -> None:
    req = parse_body(BODIES[CompletionRequest] % text, CompletionRequest)
    assert req.text == read
