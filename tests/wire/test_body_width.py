"""A chat body's width (content parts and tool calls in all its messages) is looked at before validation."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.pipeline.handle import parse_request
from wire.body_width import MAX_ITEMS, check_width
from wire.chat_request import ChatCompletionRequest


def body(messages: list[dict]) -> bytes:
    return json.dumps({"model": "mid", "messages": messages}).encode()


def parts(n: int, kind: str = "text") -> list[dict]:
    return [{"type": kind, "text": ""}] * n


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": parts(80, "t")}] * 2000,  # 160,000 bad parts: refused before one is validated
    [{"role": "user", "content": 5}] + [{"role": "user", "content": parts(80)}] * 100,  # one message the look skips
    [{"role": "assistant", "tool_calls": [CALL] * 100}] * 50,
    [{"role": "user", "content": parts(256)}] * (MAX_ITEMS // 256) + [{"role": "assistant", "tool_calls": [CALL]}],
], ids=["parts", "behind-a-bad-message", "tool-calls", "one-past"])
def test_a_body_wider_than_the_limit_is_refused_before_validation(messages: list[dict],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChatCompletionRequest, "model_validate_json",
                        lambda *_: pytest.fail("validated a body wider than the limit"))
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body(messages))
    assert refused.value.param == "messages" and refused.value.code == "too_long"
    assert str(MAX_ITEMS) in refused.value.message


def test_a_body_at_the_limit_is_validated() -> None:
    messages = ([{"role": "user", "content": parts(256)}] * (MAX_ITEMS // 256 - 1)
                + [{"role": "user", "content": parts(252)}, {"role": "assistant", "tool_calls": [CALL] * 4}])
    check_width(body(messages))
    assert len(parse_request(body(messages)).messages) == MAX_ITEMS // 256 + 1


@pytest.mark.parametrize("raw", [b"", b"[]", b"{", b'{"messages": 3}', b'{"messages": [1, "x", {"content": "[1"}]}',
                                 b' {"messages" : [ {"content" : [ {} , {} ] } ] }', b'{"messages": [{"content": [}',
                                 b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 b'{"messages": [{"content": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"],
                         ids=["empty", "array", "cut", "number", "odd", "spaces", "broken", "nested", "nested-in"])
def test_a_narrow_body_is_not_looked_at_and_the_parse_refuses_what_is_wrong(raw: bytes) -> None:
    """Including JSON nested deeper than msgspec reads (RecursionError): a 400. A wide body the look cannot read is
    refused by the look itself (tests/wire/test_hostile_json.py)."""
    check_width(raw)  # too few braces to hold MAX_ITEMS parts: not looked at
    with pytest.raises(InvalidRequest):
        parse_request(raw)


def test_validation_stops_at_the_first_bad_part() -> None:
    """Within the limit, a body of bad parts costs one error, not one per part (pydantic's fail_fast)."""
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body([{"role": "user", "content": parts(2, "t")}] * 2048))
    cause = refused.value.__cause__
    while not isinstance(cause, ValidationError):
        cause = cause.__cause__  # type: ignore[union-attr]
    assert len(cause.errors()) <= 2, cause.errors()  # the union's two members at the first bad part


@pytest.mark.parametrize("item", [b"1", b"{}"])
def test_more_messages_than_allowed_are_left_to_the_validation(item: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Looking into each of a million messages cost 0.6 s; the validation refuses their number at once."""
    import wire.body_width as width

    monkeypatch.setattr(width, "_message", None)  # any look into a message fails here
    raw = b'{"model": "mid", "messages": [' + b",".join([item] * 100_000) + b"]}"
    check_width(raw)
    with pytest.raises(InvalidRequest):
        parse_request(raw)
