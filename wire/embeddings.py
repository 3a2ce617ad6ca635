"""The OpenAI embeddings request (POST /v1/embeddings) and its answer.

`input` is one string or a list of at most MAX_INPUTS strings (OpenAI's limit), none empty and none longer than
MAX_INPUT_CHARS characters: the sentence embedder hands no more than that of a text to its tokenizer
(cache/embedder.py), which splits the whole of what it is given. The model itself reads a text's first 256 word
pieces (about 1,500 characters of ordinary text): a longer text gets the vector of that beginning and is billed for
the word pieces read (gateway/embeddings_service.py), as sentence-transformers truncates, where OpenAI refuses an
input past its model's context. Token-id inputs (a list of integers, or of lists of integers) are refused by name:
our model's tokenizer is not OpenAI's, so ids from a client mean nothing here. `dimensions` is accepted only as the
model's own (`EMBEDDING_DIM`): MiniLM's vectors cannot be shortened without changing what they measure.
`encoding_format` is `float` (the default) or `base64` (little-endian float32, what the OpenAI SDKs ask for and
decode). `user` is OpenAI's name for the tenant's end user, a hint that changes no vector (as chat's
`safety_identifier`); where the tenant's plan keeps its users apart, it is part of an Idempotency-Key's identity.

The answer's JSON (`embedding_body`) is built a piece of rows at a time, in a worker thread: for 2,048 vectors it is
about 16.6 MB and 100 ms of work that holds the GIL. One C call (a `tolist`, an encoder's) keeps it to its end, so a
single whole-answer call would stall the event loop's thread as long as running there; and a thread that only runs
gives it up when the loop's thread has waited a switch interval (5 ms) for it, so each of the loop's wake-ups waits
that long, or more with two such threads (two threads building answers without a pause, 2 busy cores: a 1 ms sleep on
the loop came p50 4.7 ms, p99 31 ms late). Between pieces the thread hands the GIL over (`time.sleep(0)`): the loop's
thread waits about a piece (p50 0.4 ms, p99 2 ms late), for the same throughput.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from wire.fields import UNSUPPORTED_VALUE, drop_nulls, nullable_optionals, one_unknown, only

MAX_INPUTS = 2048
MAX_INPUT_CHARS = 8192
EMBEDDING_DIM = 384
PIECE_ROWS = 16  # rows of an answer encoded in one call (about 100 KB of JSON floats, well under a ms)

Text = Annotated[str, Field(min_length=1, max_length=MAX_INPUT_CHARS)]


def _token_ids(value: Any) -> bool:
    return isinstance(value, int | list) and not isinstance(value, bool)


def _not_text(value: Any) -> PydanticCustomError:
    """The refusal of an input that is token ids, or a list of texts inside the list (`[["a"]]`, told it sent token
    ids before): its first item says which; nothing more of it is read."""
    if isinstance(value, list) and value and isinstance(value[0], str):
        return PydanticCustomError(UNSUPPORTED_VALUE, "a list of texts inside the list is not an input; send a text "
                                   "or one flat list of texts")
    return PydanticCustomError(UNSUPPORTED_VALUE, "token-id inputs are not supported; send the text")


def _text_inputs(value: Any) -> Any:
    """Refuse token-id inputs by name (the type check would only say "not a string"), and a list of more than
    MAX_INPUTS before any of its items is looked at: its items were each validated first, a refusal for each that
    was not a text, then the list refused for its length (a body of a million `{}` cost the event loop 434 ms)."""
    items = value if isinstance(value, list) else [value]
    if items and _token_ids(items[0]):
        raise _not_text(items[0])
    if len(items) > MAX_INPUTS:
        raise PydanticCustomError("too_long", f"at most {MAX_INPUTS} inputs in one request")
    if (first := next((v for v in items if _token_ids(v)), None)) is not None:
        raise _not_text(first)
    return value


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: the vectors of one text or of a list of texts."""

    unsupported_fields: ClassVar[dict[str, str]] = {}
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=nullable_optionals)

    input: Annotated[Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)],
                     Field(description=f"a text, or a list of at most {MAX_INPUTS} texts; each non-empty and of at "
                                       f"most {MAX_INPUT_CHARS} characters")]
    model: Annotated[str, Field(min_length=1, max_length=256)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[Literal[384], only(EMBEDDING_DIM, reason=f"this model's vectors have {EMBEDDING_DIM} "
                                             "dimensions and cannot be shortened")] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data), cls)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        return _text_inputs(value)

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def embedding_list(vectors: np.ndarray, *, model: str, prompt_tokens: int, encoding_format: str,
                   **extra: Any) -> dict[str, Any]:
    """OpenAI's answer: one `embedding` object per row of `vectors` ([N, D] float32), in input order."""
    return {"object": "list", "data": _items(np.ascontiguousarray(vectors, dtype="<f4"), 0, encoding_format),
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}, **extra}


def embedding_body(vectors: np.ndarray, *, model: str, prompt_tokens: int, encoding_format: str) -> bytes:
    """`embedding_list`'s answer as JSON, byte for byte what msgspec's encoder (Litestar's) writes for it, encoded
    `PIECE_ROWS` rows at a time (the module's docstring says why). CPU-heavy for a large answer: call it in a worker
    thread."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    shell = msgspec.json.encode(embedding_list(rows[:0], model=model, prompt_tokens=prompt_tokens,
                                               encoding_format=encoding_format))
    head, tail = shell.split(b'"data":[]', 1)  # the first: any other quote is escaped inside a string
    pieces = [head, b'"data":[']
    for start in range(0, len(rows), PIECE_ROWS):
        if start:
            pieces.append(b",")
            time.sleep(0)  # the GIL handed over: a thread waiting for it (the event loop's) takes its turn now
        pieces.append(msgspec.json.encode(_items(rows[start:start + PIECE_ROWS], start, encoding_format))[1:-1])
    pieces += [b"]", tail]
    return b"".join(pieces)


def _items(rows: np.ndarray, first: int, encoding_format: str) -> list[dict[str, Any]]:
    """The `embedding` objects of `rows` (little-endian float32), the first with index `first`."""
    if encoding_format == "base64":
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode() for row in rows]
    else:
        embeddings = rows.tolist()
    return [{"object": "embedding", "index": first + i, "embedding": e} for i, e in enumerate(embeddings)]
