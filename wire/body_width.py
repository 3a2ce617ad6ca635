"""How wide a chat body is, looked at before it is validated: content parts and tool calls, in all its messages.

Each message may have up to 256 content parts and 128 tool calls, and a request up to 2,048 messages, so a body
within the size limit could hold 160,000 parts of `{"type": "text", "text": ""}`. Validating those took pydantic
0.5 s of the event loop, and refusing them (one error object per bad part) 0.75 s: every tenant's requests waited,
and a refusal charges nothing, so nothing else bounded how often one tenant could ask. This look reads the body
with msgspec once, listing its messages as raw bytes as it goes, and then each message it counts, the parts and
calls as raw bytes it never builds into objects (4.3 ms for a 4 MB body of them, the brace count below included;
0.5 ms for 125 KB of 4,100 parts), and refuses a body with more than MAX_ITEMS of them in all before pydantic sees
it. A body it read is not read again (wire/validation.parse_body): reading it before this look too, and listing its
messages in a read of their own, made the same 4 MB body cost 10.4 ms.

A body with no more than MAX_ITEMS `{` in all cannot hold more than MAX_ITEMS parts and calls and is not looked at
(a count over its bytes: about a millisecond for 4 MB). A body this look cannot read (not JSON, not an object,
nested too deep) is refused here (400 `invalid_json`, with the error wire/validation.parse_body's own read gives),
never left to the validation: pydantic's parser reads what msgspec's does not (`NaN`, `Infinity`: not JSON), and a
body of 160,000 parts with a `NaN` in a tool's `parameters` skipped this look and cost the validation 0.8-1.9 s of
the event loop. A message that is not an object, and a body with more than MAX_MESSAGES messages, are left
to the validation, which refuses them with the precise error, cheaply: those errors are about one value, not one
per part (and the lists stop at their first bad item: `fail_fast`). What stays is the parse itself: a body near the
4 MiB limit costs the validation 50-130 ms of the event loop to refuse (1.9 million messages of `1`, or 1.3 million
of `{}`), as before, and the second kind this look 70 ms more (its braces pass the count; listing the messages
costs that).
"""

from __future__ import annotations

import re

import msgspec

from wire.validation import UNREADABLE, BodyError, unreadable

MAX_ITEMS = 4096  # content parts and tool calls in all of a request's messages
MAX_MESSAGES = 2048  # a request's (wire/chat_request.py); a body with more is not looked into: the validation
# refuses it at once (fail_fast), and looking into each of a million messages cost 0.6 s


class _Top(msgspec.Struct):
    messages: list[msgspec.Raw] | None = None  # listed as the body is read; anything but a list fails the read


class _Shape(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"null")  # whatever it is, the last one


class _Message(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw(b"null")
    tool_calls: msgspec.Raw = msgspec.Raw(b"null")


_top = msgspec.json.Decoder(_Top)
_raws = msgspec.json.Decoder(list[msgspec.Raw])
_shape = msgspec.json.Decoder(_Shape)
_message = msgspec.json.Decoder(_Message)
_AN_OBJECT = re.compile(rb"[ \t\n\r]*\{")  # JSON that starts as an object (RFC 8259's whitespace before it)


def check_width(body: bytes) -> bool:
    """Raise BodyError when the chat body's messages hold more than MAX_ITEMS content parts and tool calls, or when
    a body wide enough to be looked at is not JSON. True when it read all of the body (as msgspec reads JSON: the
    body need not be read again), False when it did not look (wire/validation.parse_body reads it then)."""
    if body.count(b"{") <= MAX_ITEMS:  # every part and call is an object: a body with fewer braces holds fewer
        return False
    try:
        items = _count(_messages(body))
    except UNREADABLE as exc:  # refused, not skipped: what msgspec cannot read, pydantic may, part by part
        raise unreadable(body, exc) from exc
    if items > MAX_ITEMS:
        raise BodyError(f"messages: at most {MAX_ITEMS} content parts and tool calls in all the messages of a "
                        "request", "messages", "too_long")
    return True


def _messages(body: bytes) -> list[msgspec.Raw]:
    """The body's messages, as raw bytes, in one read of all of it where they are a list (none where they are not:
    the validation says so). Raises what msgspec's plain read of the body raises, so the client's error is the same."""
    try:
        return _top.decode(body).messages or []
    except msgspec.ValidationError as exc:  # not an object, or a `messages` not a list: the read stopped there
        stopped = exc
    if _AN_OBJECT.match(body) is None:
        msgspec.json.decode(body, type=msgspec.Raw)  # the rest, for what in it is not JSON: that error comes first
        raise stopped
    # a `messages` that is not a list may come before one that is, and pydantic validates the last one: a body of
    # `{"messages": 3, "messages": [160,000 parts]}` is counted too
    return _lists(_shape.decode(body).messages)


def _count(listed: list[msgspec.Raw]) -> int:
    """The content parts and tool calls of the messages, counted until they pass MAX_ITEMS (0 for more than
    MAX_MESSAGES messages: the validation refuses that at its first look)."""
    if len(listed) > MAX_MESSAGES:
        return 0
    items = 0
    for raw in listed:
        try:
            message = _message.decode(raw)
        except msgspec.ValidationError:
            continue  # JSON, but not an object: the validation says so
        for field in (message.content, message.tool_calls):
            items += len(_lists(field))
        if items > MAX_ITEMS:
            break
    return items


def _lists(raw: msgspec.Raw) -> list[msgspec.Raw]:
    """The items of a JSON array (as raw bytes); none for anything else."""
    if memoryview(raw)[:1].tobytes() != b"[":
        return []
    return _raws.decode(raw)
