"""`prompt_cache_retention` as the OpenAI SDKs spell it: the installed `openai` client types it `"in_memory" | "24h"`
(OpenAI's API reference once wrote `"in-memory"`). Our engines' prefix cache lives in their memory, so both spellings
of in-memory are accepted, by the model and by its published schema, and `24h` is refused by name."""

from __future__ import annotations

import json
import typing

import jsonschema
import pytest
from openai.types.chat import completion_create_params

from wire.chat_request import ChatCompletionRequest
from wire.validation import BodyError, parse_body

CHAT = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}


def _documented(body: dict) -> bool:
    return jsonschema.Draft202012Validator(ChatCompletionRequest.model_json_schema()).is_valid(body)


def _client_values() -> set[str]:
    hint = typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)["prompt_cache_retention"]
    return {v for arg in typing.get_args(hint) for v in typing.get_args(arg)}


def test_the_clients_in_memory_is_accepted() -> None:
    (in_memory,) = _client_values() - {"24h"}
    for value in (in_memory, "in-memory"):
        body = CHAT | {"prompt_cache_retention": value}
        assert parse_body(json.dumps(body).encode(), ChatCompletionRequest).prompt_cache_retention == value
        assert _documented(body), value


@pytest.mark.parametrize("value", ["24h", "in memory", ""])
def test_another_retention_is_refused_by_name(value: str) -> None:
    body = CHAT | {"prompt_cache_retention": value}
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert refused.value.param == "prompt_cache_retention" and refused.value.code == "unsupported_value"
    assert not _documented(body)
