"""A request body to a typed request, or the OpenAI-style error that names the offending field.

A body is read as JSON (RFC 8259) by msgspec before pydantic validates it: pydantic's parser also takes `NaN`,
`Infinity` and `-Infinity`, which are not JSON, and a body with one inside a free-form object (a tool's
`parameters`, a `json_schema`'s schema) passed as a valid request. msgspec reads JSON only and skims a body without
building it (about 0.5 ms a megabyte), so such a body is refused (400 `invalid_json`) before any validation. A look
before the validation (wire/body_width.py) that reads a body itself reads it as msgspec does and refuses what it
cannot read with the same error, never leaves it to a validation that reads more than msgspec does; that body is
not read again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
UNKNOWN_FIELD = "this endpoint does not know it"
MAX_NAME_CHARS = 64  # of a name in a refusal's `param` and message (OpenAI's longest field names are under 30)
_UNION_MEMBER = re.compile(r"str|int|float|bool|none|[\w-]+\[.*\]|(function|constrained)-.*")
NOT_JSON = "we could not parse the JSON body of your request"
# a validator of ours that recursed past Python's stack: schema_costs bounds what it follows, and this keeps any
# other shape a 400 rather than a 500 (1,150 `$ref`s, each to the one defined before, were one)
TOO_DEEP = ("the request nests too deeply to validate (a schema's subschemas and the `$ref`s it follows, one into "
            "another, count as nesting); send a shallower one")
UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)  # msgspec's refusals of a body
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")  # where msgspec's DecodeError says the body went wrong
_NON_FINITE = (b"NaN", b"Infinity")  # `-Infinity`: msgspec points past its sign
# a `\uXXXX` escape of a UTF-16 surrogate, with the low one that may follow it: a high one with its low one is a
# character, any other is half of one (`_lone_surrogate` looks at the first few, each with a short look back)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?")
_MAX_SURROGATE_LOOKS = 64
_MAX_BACKSLASH_RUN = 1024


@dataclass(frozen=True)
class BodyError(Exception):
    """The body is not a valid request: `message` for the client, `param` the field, `code` the kind."""

    message: str
    param: str | None
    code: str

    def __str__(self) -> str:
        return self.message


def parse_body(body: bytes, model: type[M]) -> M:
    """Validate `body` (JSON) as `model`; raises BodyError (nothing else) when it is not one. A model's
    `look_before_validating(body)`, where it has one, may refuse the body first (wire/body_width.py); it returns
    True where it read all of the body as msgspec reads JSON (refusing, with `unreadable`'s error, what it could
    not read), and such a body is not read again (a wide chat body of 4 MB was read three times: 10.4 ms to refuse,
    4.3 ms read once)."""
    if not body.strip():
        raise BodyError("the request body is empty; send a JSON object", None, "invalid_json")
    look = getattr(model, "look_before_validating", None)
    if look is None or not look(body):
        try:
            msgspec.json.decode(body, type=msgspec.Raw)  # read, not built: JSON only, whatever pydantic's parser takes
        except UNREADABLE as exc:
            raise unreadable(body, exc) from exc
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise describe(exc, getattr(model, "unsupported_fields", {})) from exc
    except RecursionError as exc:  # a check that recursed past the stack (a schema's references): the body's doing
        raise BodyError(TOO_DEEP, None, "invalid_value") from exc


def unreadable(body: bytes, exc: Exception) -> BodyError:
    """The client's error for a body msgspec could not read as JSON (`exc`, one of UNREADABLE)."""
    if isinstance(exc, RecursionError):
        return BodyError(f"{NOT_JSON}: it is nested too deeply", None, "invalid_json")
    if isinstance(exc, msgspec.ValidationError):  # read as JSON, but not the object a request is
        return BodyError("the request body must be a JSON object", None, "invalid_json")
    where = _AT_BYTE.search(str(exc))
    if where is not None and body.startswith(_NON_FINITE, int(where[1])):
        return BodyError(f"{NOT_JSON}: NaN, Infinity and -Infinity are not JSON numbers (RFC 8259), at byte "
                         f"{where[1]}; send a number, or null", None, "invalid_json")
    # msgspec's words for half a surrogate pair are "Input data was truncated" or a bad hex escape after it
    if (alone := _lone_surrogate(body)) is not None and (where is None or int(where[1]) >= alone):
        return BodyError(f"{NOT_JSON}: the \\u escape at byte {alone} is half of a UTF-16 surrogate pair, which alone "
                         "is not a character (a string cut inside an emoji?); send whole characters", None,
                         "invalid_json")
    return BodyError(f"{NOT_JSON}: {exc}", None, "invalid_json")


def _lone_surrogate(body: bytes) -> int | None:
    """Where the first escape of half a UTF-16 surrogate pair in `body` starts (a high one without its low one, or a
    low one alone), or None, also when it cannot tell cheaply: it only words a refusal, so it looks at the first
    _MAX_SURROGATE_LOOKS escapes and _MAX_BACKSLASH_RUN bytes back from each (a search as fast as msgspec's read)."""
    for k, escape in enumerate(_SURROGATE_ESCAPE.finditer(body)):
        if k == _MAX_SURROGATE_LOOKS:
            return None
        start = escape.start()
        before = body[max(0, start - _MAX_BACKSLASH_RUN):start]
        run = len(before) - len(before.rstrip(b"\\"))  # backslashes just before it
        if run == _MAX_BACKSLASH_RUN:
            return None
        if run % 2 == 0 and (escape[1] not in b"89abAB" or escape[2] is None):  # odd: `\\u`, text
            return start
    return None


def describe(exc: ValidationError, unsupported: dict[str, str] | None = None) -> BodyError:
    """The first error of `exc`, worded for the client; `unsupported` says why known fields are refused."""
    errors = exc.errors(include_url=False)
    # of a union's failed members, the one of the input's own type says more ("at most 4 items", not "a string")
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    kind = err["type"]
    if kind == "json_invalid":
        return BodyError("we could not parse the JSON body of your request: "
                         f"{err.get('ctx', {}).get('error', err['msg'])}", None, "invalid_json")
    if kind == "model_type" and not err["loc"]:
        return BodyError("the request body must be a JSON object", None, "invalid_json")
    # pydantic names union members in the location ("str", "list[...]", "function-after[...]"); drop them, but for
    # the field an object does not know, which is the client's own name, whatever it is ("str" was not named)
    where = err["loc"]
    named = len(where) - 1 if kind == "extra_forbidden" else len(where)
    # and a name of the client's is cut to MAX_NAME_CHARS: an unknown field of 4 MB was sent back twice (param and
    # message), an 8 MB answer to a refused body
    loc = [str(p)[:MAX_NAME_CHARS] for i, p in enumerate(where)
           if i == named or (not _UNION_MEMBER.fullmatch(str(p)) and p != "[key]")]
    param = ".".join(loc) or None
    if kind == "extra_forbidden" and param is not None:
        name = loc[-1]
        return BodyError(f"{param}: unsupported parameter ({(unsupported or {}).get(name, UNKNOWN_FIELD)}); "
                         "remove it", param, "unsupported_parameter")
    # a validator's own words, without pydantic's "Value error, " before them
    text = str(err["ctx"]["error"]) if kind == "value_error" and "error" in err.get("ctx", {}) else err["msg"]
    message = f"{param}: {text}" if param else text
    return BodyError(message, param, kind)
