"""The OpenAI embeddings request (POST /v1/embeddings) and its answer.

`input` is one string or a list of at most MAX_INPUTS strings (OpenAI's limit), none empty and none longer than
MAX_INPUT_CHARS characters: the sentence embedder reads no more than that of a text (cache/embedder.py), so a
longer text would get the vector of its beginning, silently. Token-id inputs (a list of integers, or of lists of
integers) are refused by name: our model's tokenizer is not OpenAI's, so ids from a client mean nothing here.
`dimensions` is accepted only as the model's own (`EMBEDDING_DIM`): MiniLM's vectors cannot be shortened
without changing what they measure. `encoding_format` is `float` (the default) or `base64` (little-endian
float32, what the OpenAI SDKs ask for and decode).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from wire.fields import UNSUPPORTED_VALUE, drop_nulls, nullable_optionals, only

MAX_INPUTS = 2048
MAX_INPUT_CHARS = 8192
EMBEDDING_DIM = 384

Text = Annotated[str, Field(min_length=1, max_length=MAX_INPUT_CHARS)]


def _text_inputs(value: Any) -> Any:
    """Refuse token-id inputs by name (the type check would only say "not a string")."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(v, int | list) and not isinstance(v, bool) for v in items):
        raise PydanticCustomError(UNSUPPORTED_VALUE, "token-id inputs are not supported; send the text")
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
        return drop_nulls(data)

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
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    encode = (lambda row: base64.b64encode(row.tobytes()).decode()) if encoding_format == "base64" \
        else (lambda row: row.tolist())
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": encode(row)}
                                       for i, row in enumerate(rows)],
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}, **extra}
