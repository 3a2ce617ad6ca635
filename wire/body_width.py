"""How wide a chat body is, looked at before it is validated: content parts and tool calls, in all its messages.

Each message may have up to 256 content parts and 128 tool calls, and a request up to 2,048 messages, so a body
within the size limit could hold 160,000 parts of `{"type": "text", "text": ""}`. Validating those took pydantic
0.5 s of the event loop, and refusing them (one error object per bad part) 0.75 s: every tenant's requests waited,
and a refusal charges nothing, so nothing else bounded how often one tenant could ask. This look reads the body's
structure with msgspec, the parts and calls as raw bytes it never builds into objects (5.5 ms for a 4 MB body of
them, about 1 ms for 150 KB of 4,000 parts), and refuses a body with more than MAX_ITEMS of them in all before
pydantic sees it.

A body this look cannot read (not JSON, not an object, `messages` not a list, nested too deep) is left to the
validation, which refuses it with the precise error, cheaply: those errors are about one value, not one per part
(and the lists stop at their first bad item: `fail_fast`).
"""

from __future__ import annotations

import msgspec

from wire.validation import BodyError

MAX_ITEMS = 4096  # content parts and tool calls in all of a request's messages
# what this look leaves to the validation: not JSON, not the shape it reads, or nested deeper than msgspec reads
_UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


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
    try:
        messages = _top.decode(body).messages
    except _UNREADABLE:
        return
    items = 0
    for raw in _lists(messages):
        try:
            message = _message.decode(raw)
        except _UNREADABLE:
            continue  # not an object: the validation says so
        for field in (message.content, message.tool_calls):
            items += len(_lists(field))
        if items > MAX_ITEMS:
            raise BodyError(f"messages: at most {MAX_ITEMS} content parts and tool calls in all the messages of a "
                            "request", "messages", "too_long")


def _lists(raw: msgspec.Raw) -> list[msgspec.Raw]:
    """The items of a JSON array (as raw bytes); none for anything else."""
    if memoryview(raw)[:1].tobytes() != b"[":
        return []
    try:
        return _raws.decode(raw)
    except _UNREADABLE:
        return []
