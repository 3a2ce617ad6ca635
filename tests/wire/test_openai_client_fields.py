"""Every request field the installed `openai` client defines is one our request models know: honoured (a field of
the model) or refused with its own reason (`unsupported_fields`), never "a parameter this server does not know";
and `OPENAI_FIELDS`, the chat request's list of OpenAI's fields, is the client's list."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params

from wire.chat_request import OPENAI_FIELDS, ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.embeddings import EmbeddingRequest
from wire.validation import UNKNOWN_FIELD, BodyError, parse_body

CASES = [
    (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase,
     {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    (CompletionRequest, completion_create_params.CompletionCreateParamsBase, {"model": "m", "prompt": "hi"}),
    (EmbeddingRequest, embedding_create_params.EmbeddingCreateParams, {"model": "m", "input": "hi"}),
]


def _client_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params))


@pytest.mark.parametrize(("model", "params", "body"), CASES, ids=["chat", "text", "embeddings"])
def test_every_client_field_is_known(model: type, params: type, body: dict) -> None:
    unknown = {f for f in _client_fields(params) if f not in model.model_fields and f not in model.unsupported_fields}
    assert not unknown, unknown
    for field in model.unsupported_fields:  # a refusal names the field and says why
        with pytest.raises(BodyError) as refused:
            parse_body(json.dumps(body | {field: {"x": 1}}).encode(), model)
        assert refused.value.param == field and UNKNOWN_FIELD not in refused.value.message


def test_the_chat_list_of_openai_fields_is_the_clients() -> None:
    streaming = _client_fields(chat_create_params.CompletionCreateParamsStreaming)  # its base's fields and `stream`
    assert set(OPENAI_FIELDS) == streaming
