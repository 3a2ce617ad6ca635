"""A list of texts longer than its field's bound (`input` of embeddings, `prompt` of text completions) is refused
for its length before any of its items is looked at. The embeddings list's items were each validated first, with a
refusal for each that was not a text, and then the list refused for its length: a body of a million `{}` cost the
event loop 434 ms to refuse (210 ms now, as a chat body of as many messages). The prompt's were each looked at for
token ids before its length was."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from wire.completion_request import CompletionRequest
from wire.embeddings import MAX_INPUTS, EmbeddingRequest
from wire.validation import BodyError, describe, parse_body


class NotLookedAt(Exception):
    """An item of the list was looked at."""


class Untouchable(list[Any]):
    """A list whose items may be counted and the first one read, but never gone through."""

    def __iter__(self) -> Any:
        raise NotLookedAt

    def __getitem__(self, index: Any) -> Any:
        if index != 0:
            raise NotLookedAt
        return super().__getitem__(index)


@pytest.mark.parametrize(("model", "field", "size", "code"), [
    (EmbeddingRequest, "input", MAX_INPUTS + 1, "too_long"),
    (CompletionRequest, "prompt", 2, "unsupported_value"),
])
def test_a_list_over_its_bound_is_refused_without_looking_at_its_items(
        model: type[BaseModel], field: str, size: int, code: str) -> None:
    with pytest.raises(ValidationError) as refused:
        model.model_validate({"model": "m", field: Untouchable([{}] * size)})
    err = describe(refused.value)
    assert (err.param, err.code, refused.value.error_count()) == (field, code, 1)


def test_embeddings_over_the_bound_are_one_refusal_naming_input() -> None:
    body = json.dumps({"model": "m", "input": [None] * 100_000}).encode()
    with pytest.raises(BodyError) as refused:
        parse_body(body, EmbeddingRequest)
    assert (refused.value.param, refused.value.code) == ("input", "too_long")
    assert str(MAX_INPUTS) in refused.value.message


@pytest.mark.parametrize(("model", "field", "value", "code"), [
    (EmbeddingRequest, "input", [1] * (MAX_INPUTS + 1), "unsupported_value"),  # token ids, however many
    (EmbeddingRequest, "input", ["a", [1, 2]], "unsupported_value"),
    (CompletionRequest, "prompt", [1, 2, 3], "unsupported_value"),
    (CompletionRequest, "prompt", [[1], [2]], "unsupported_value"),
])
def test_token_ids_are_still_refused_as_token_ids(model: type[BaseModel], field: str, value: Any, code: str) -> None:
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps({"model": "m", field: value}).encode(), model)
    assert (refused.value.param, refused.value.code) == (field, code) and "token-id" in refused.value.message


@pytest.mark.parametrize("value", [[["a"]], ["a", ["b", "c"]]])
def test_a_list_of_texts_inside_the_list_is_not_called_token_ids(value: Any) -> None:
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps({"model": "m", "input": value}).encode(), EmbeddingRequest)
    assert (refused.value.param, refused.value.code) == ("input", "unsupported_value")
    assert "token-id" not in refused.value.message and "flat list of texts" in refused.value.message
