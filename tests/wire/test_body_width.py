"""A chat body's width (content parts and tool calls in all its messages) is looked at before validation."""

from __future__ import annotations

import json

import msgspec
import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.pipeline.handle import parse_request
from wire.body_width import MAX_ITEMS, check_width
from wire.chat_request import ChatCompletionRequest
from wire.validation import UNREADABLE, BodyError, parse_body, unreadable


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


class _Counted:
    """A msgspec decoder that adds the bytes it reads to `read`."""

    def __init__(self, decoder: msgspec.json.Decoder, read: list[int]) -> None:
        self.decoder, self.read = decoder, read

    def decode(self, buf: bytes | msgspec.Raw) -> object:
        self.read.append(memoryview(buf).nbytes)
        return self.decoder.decode(buf)


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """What msgspec reads, read by read: the parse's plain read and the look's decoders."""
    import wire.body_width as width

    read: list[int] = []
    plain = msgspec.json.decode

    def decode(buf: bytes, **kwargs: object) -> object:
        read.append(memoryview(buf).nbytes)
        return plain(buf, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(msgspec.json, "decode", decode)
    for name, value in vars(width).items():
        if isinstance(value, msgspec.json.Decoder):
            monkeypatch.setattr(width, name, _Counted(value, read))
    return read


def test_a_wide_body_is_read_once(bytes_read: list[int]) -> None:
    """It was read three times (the parse's read, the look's, and its messages again): 10.4 ms to refuse 4 MB of
    parts, 4.3 ms read once. What the look reads again is the few messages it counts until the limit."""
    raw = body([{"role": "user", "content": parts(256)}] * 625)
    with pytest.raises(BodyError) as refused:
        parse_body(raw, ChatCompletionRequest)
    assert refused.value.code == "too_long"
    assert sum(bytes_read) < 1.1 * len(raw), f"read {sum(bytes_read) / len(raw):.2f} times"


def test_a_narrow_body_is_read_once(bytes_read: list[int]) -> None:
    raw = body([{"role": "user", "content": parts(2)}] * 3)
    parse_body(raw, ChatCompletionRequest)
    assert bytes_read == [len(raw)]


PART = b'{"type": "text", "text": ""}'
MESSAGES = b"[" + b", ".join([b'{"role": "user", "content": [' + b", ".join([PART] * 256) + b"]}"] * 20) + b"]"
BRACES = b", ".join([b"{}"] * (MAX_ITEMS + 1))  # enough to be looked at


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": ' + MESSAGES + b', "t": NaN}',
    b'{"t": -Infinity, "model": "m", "messages": ' + MESSAGES + b"}",
    b"[" + BRACES + b", NaN]",  # not an object, and not JSON further on: the second is the error
    b"[" + BRACES + b", ",
    b'"x" ' + BRACES,
    b'{"model": "m", "messages": 3, "x": [' + BRACES + b'], "t": Infinity}',  # the look's read stops at `3`
    b'{"model": "m", "messages": "s", "x": [' + BRACES + b'], "t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "m", "messages": ' + MESSAGES + b"} x",
    b'{"model": "m", "messages": ' + MESSAGES,
    b'{"model": "m", "messages": [' + b"[" * 100_000 + b"]" * 100_000 + b", " + BRACES + b"]}",
], ids=["nan-last", "infinity-first", "array-nan", "array-cut", "string", "messages-3-infinity",
        "messages-string-deep", "trailing", "cut", "deep-message"])
def test_a_wide_body_is_refused_as_the_plain_read_refuses_it(raw: bytes) -> None:
    """The look reads a wide body in the parse's place, so it refuses it with the error the parse's own read gives
    (the byte of a NaN, nesting too deep, cut short), wherever the look's own read stopped first."""
    assert raw.count(b"{") > MAX_ITEMS
    with pytest.raises(UNREADABLE) as plain:
        msgspec.json.decode(raw, type=msgspec.Raw)
    with pytest.raises(BodyError) as refused:
        parse_body(raw, ChatCompletionRequest)
    assert refused.value == unreadable(raw, plain.value)


@pytest.mark.parametrize("raw", [b"[" + BRACES + b"]", b" \n[" + BRACES + b"]", b"[" + BRACES[:10] + b"]"],
                         ids=["wide", "after-spaces", "narrow"])
def test_json_that_is_not_an_object_is_refused_as_such(raw: bytes) -> None:
    with pytest.raises(BodyError) as refused:
        parse_body(raw, ChatCompletionRequest)
    assert refused.value == BodyError("the request body must be a JSON object", None, "invalid_json")


@pytest.mark.parametrize("first", [b"3", b"null", b'"s"', b"{}"])
def test_messages_given_twice_are_counted_as_the_validation_reads_them(first: bytes,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic validates the last `messages`: one before it that is not a list must not hide it from the look."""
    monkeypatch.setattr(ChatCompletionRequest, "model_validate_json",
                        lambda *_: pytest.fail("validated a body wider than the limit"))
    with pytest.raises(BodyError) as refused:
        parse_body(b'{"model": "m", "messages": ' + first + b', "messages": ' + MESSAGES + b"}",
                   ChatCompletionRequest)
    assert refused.value.code == "too_long"
