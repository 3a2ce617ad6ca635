"""How wide a chat body is, looked at before it is validated: content parts and tool calls, in all its messages.

Each message may have up to 256 content parts and 128 tool calls, and a request up to 2,048 messages, so a body
within the size limit could hold 160,000 parts of `{"type": "text", "text": ""}`. Validating those took pydantic
0.5 s of the event loop, and refusing them (one error object per bad part) 0.75 s: every tenant's requests waited,
and a refusal charges nothing, so nothing else bounded how often one tenant could ask. This look reads the body's
structure with msgspec, the parts and calls as raw bytes it never builds into objects (5.5 ms for a 4 MB body of
them, about 1 ms for 150 KB of 4,000 parts), and refuses a body with more than MAX_ITEMS of them in all before
pydantic sees it.

A body with no more than MAX_ITEMS `{` in all cannot hold more than MAX_ITEMS parts and calls and is not looked at
(a count over its bytes: about a millisecond for 4 MB). A body this look cannot read (not JSON, not an object,
nested too deep) is refused here (400 `invalid_json`), never left to the validation: pydantic's parser reads what
msgspec's does not (`NaN`, `Infinity`: not JSON), and a body of 160,000 parts with a `NaN` in a tool's `parameters`
skipped this look and cost the validation 0.8-1.9 s of the event loop (wire/validation.parse_body refuses such a body
before this look too). A message that is not an object, and a body with more than MAX_MESSAGES messages, are left
to the validation, which refuses them with the precise error, cheaply: those errors are about one value, not one
per part (and the lists stop at their first bad item: `fail_fast`). What stays is the parse itself: a body near the
4 MiB limit costs the validation 50-130 ms of the event loop to refuse (1.9 million messages of `1`, or 1.3 million
of `{}`), as before, and the second kind this look 64 ms more (its braces pass the count; listing the messages
costs that).
"""

from __future__ import annotations

import msgspec

from wire.validation import UNREADABLE, BodyError, unreadable

MAX_ITEMS = 4096  # content parts and tool calls in all of a request's messages
MAX_MESSAGES = 2048  # a request's (wire/chat_request.py); a body with more is not looked into: the validation
# refuses it at once (fail_fast), and looking into each of a million messages cost 0.6 s


class _Top(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"null")


class _Message(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw(b"null")
    tool_calls: msgspec.Raw = msgspec.Raw(b"null")


_top = msgspec.json.Decoder(_Top)
_raws = msgspec.json.Decoder(list[msgspec.Raw])
_message = msgspec.json.Decoder(_Message)


def check_width(body: bytes) -> None:
    """Raise BodyError when the chat body's messages hold more than MAX_ITEMS content parts and tool calls."""
    if body.count(b"{") <= MAX_ITEMS:  # every part and call is an object: a body with fewer braces holds fewer
        return
    try:
        items = _count(body)
    except UNREADABLE as exc:  # refused, not skipped: what msgspec cannot read, pydantic may, part by part
        raise unreadable(body, exc) from exc
    if items > MAX_ITEMS:
        raise BodyError(f"messages: at most {MAX_ITEMS} content parts and tool calls in all the messages of a "
                        "request", "messages", "too_long")


def _count(body: bytes) -> int:
    """The content parts and tool calls of the body's messages, counted until they pass MAX_ITEMS (0 for more than
    MAX_MESSAGES messages: the validation refuses that at its first look)."""
    listed = _lists(_top.decode(body).messages)
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
