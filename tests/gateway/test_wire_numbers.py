"""JSON has one number type: an integer field takes 5.0 as 5 (as JSON Schema's `integer` does, and so the
published document), and still refuses 5.5, "5" and true; top_logprobs without logprobs stays refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from wire.chat_request import ChatCompletionRequest

BASE = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}


def test_integral_numbers_are_integers() -> None:
    req = ChatCompletionRequest.model_validate(BASE | {"max_tokens": 5.0, "seed": 7.0, "top_k": -1.0})
    assert (req.max_tokens, req.seed, req.top_k) == (5, 7, -1) and type(req.max_tokens) is int


@pytest.mark.parametrize("bad", [5.5, "5", True, float("inf"), 1e300])
def test_anything_else_is_still_refused(bad: object) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(BASE | {"max_tokens": bad})


def test_top_logprobs_need_logprobs_as_the_document_says() -> None:
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate(BASE | {"top_logprobs": 2.0})
    assert ChatCompletionRequest.model_validate(BASE | {"top_logprobs": 2, "logprobs": True}).top_logprobs == 2
    rule = ChatCompletionRequest.model_json_schema()["allOf"][0]
    assert rule["then"]["properties"]["logprobs"] == {"const": True}
