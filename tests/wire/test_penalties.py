"""`presence_penalty` and `frequency_penalty`, on chat and text completions alike: a number within [-2, 2], as
OpenAI's; anything else a 400 naming the field, type-exact (a string or a boolean is not a number), and the published
schema says the same."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import pytest

from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.validation import BodyError, parse_body

BODIES = [(ChatCompletionRequest, {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}),
          (CompletionRequest, {"model": "mid", "prompt": "hi"})]
FIELDS = ["presence_penalty", "frequency_penalty"]


@cache
def _validator(model: type) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(model.model_json_schema())


def documented(model: type, body: dict[str, Any]) -> bool:
    """Whether the model's published JSON schema allows `body`."""
    return _validator(model).is_valid(body)


@pytest.mark.parametrize(("model", "base"), BODIES, ids=["chat", "text"])
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("value", "code"), [
    (2.5, "less_than_equal"), (-3, "greater_than_equal"), (2.0000001, "less_than_equal"), ("0.5", "float_type"),
    (True, "float_type"), (False, "float_type"), ([0.5], "float_type"), ({"x": 1}, "float_type"),
])
def test_a_bad_penalty_is_refused_naming_it(model: type, base: dict[str, Any], field: str, value: object,
                                             code: str) -> None:
    body = base | {field: value}
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), model)
    assert refused.value.param == field and refused.value.code == code
    assert refused.value.message.startswith(f"{field}: ")
    assert not documented(model, body)


@pytest.mark.parametrize(("model", "base"), BODIES, ids=["chat", "text"])
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("value", "read"), [(0.5, 0.5), (-2, -2.0), (2, 2.0), (-1.75, -1.75), (0, 0.0),
                                             (None, None)])
def test_a_penalty_within_the_range_is_read_as_a_number(model: type, base: dict[str, Any], field: str,
                                                        value: object, read: float | None) -> None:
    body = base | {field: value}
    got = getattr(parse_body(json.dumps(body).encode(), model), field)
    assert got == read and (got is None or type(got) is float)
    assert documented(model, body)


def test_an_integer_beyond_floats_range_is_a_400_not_a_crash() -> None:
    """Read as a number, it overflowed float() in the validator that makes integers numbers (a 500 for temperature)."""
    for field in (*FIELDS, "temperature", "top_p"):
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "%s": -1%s}' % (
            field.encode(), b"0" * 400)
        with pytest.raises(BodyError) as refused:
            parse_body(body, ChatCompletionRequest)
        assert refused.value.param == field
