"""An empty stop string is refused by name, in chat and text completions alike, and the published schema says so.

Servers do not agree on what it means: our engine matched it nowhere (engine/detokenizer.py skipped it), vLLM refuses
it ("stop cannot contain an empty string"), and a server that looks for it in the text finds it at once. The gateway
passed it to remote tiers as sent, so one request meant three things depending on the tier; refused, it means the same
everywhere (and our engine refuses it too, for callers that do not come through the gateway)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.validation import BodyError, parse_body

BODIES = [(ChatCompletionRequest, {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}),
          (CompletionRequest, {"model": "mid", "prompt": "hi"})]


@pytest.mark.parametrize(("model", "body"), BODIES, ids=["chat", "text"])
@pytest.mark.parametrize(("stop", "param"), [("", "stop"), ([""], "stop.0"), (["\n", ""], "stop.1")])
def test_an_empty_stop_string_is_refused_by_name(model: type, body: dict[str, Any], stop: Any, param: str) -> None:
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body | {"stop": stop}).encode(), model)
    assert refused.value.param == param and refused.value.code == "string_too_short"
    assert refused.value.message.startswith(f"{param}: a stop string may not be empty")
    assert not jsonschema.Draft202012Validator(model.model_json_schema()).is_valid(body | {"stop": stop})


@pytest.mark.parametrize(("model", "body"), BODIES, ids=["chat", "text"])
@pytest.mark.parametrize("stop", [" ", ["\n"], [], None])
def test_a_stop_string_of_any_character_and_no_stop_are_accepted(model: type, body: dict[str, Any],
                                                                 stop: Any) -> None:
    parsed = parse_body(json.dumps(body | {"stop": stop}).encode(), model)
    assert parsed.stop_list == ([] if stop is None else [stop] if isinstance(stop, str) else stop)
