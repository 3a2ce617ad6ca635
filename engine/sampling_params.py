"""How a sequence's next token is chosen and when it ends.

The engine checks every parameter again, whoever calls it (the HTTP server validates with the same bounds
from wire/chat_request.py, but a direct caller of `LLMEngine.generate` does not go through it): a value the
sampler cannot handle safely is an `EngineInputError` naming the field, never a dead engine loop.

`response_format` is checked against wire/response_format.py's shapes and bounds; the engine compiles it
(engine/grammar.py) and sets `grammar` on its own copy of the parameters, which the sampler then applies. A
constraining one refuses `stop` (naming it, `unsupported_value`): a stop string matched inside the JSON ended the
sequence with its grammar unfinished, and the answer read as complete (finish_reason "stop").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from wire.chat_request import MAX_PENALTY, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MIN_TEMPERATURE
from wire.response_format import ResponseFormat

MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


class EngineInputError(ValueError):
    """The request can never be served by this engine (a bad parameter, too long, empty); maps to HTTP 400.

    `param` names the offending request field; `code` is the OpenAI error code.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means off
    max_tokens: int = 256
    seed: int | None = None  # a seeded request samples the same tokens every time
    # OpenAI's penalties, each within [-MAX_PENALTY, MAX_PENALTY]: before any sampling rule, each token's logit less
    # frequency_penalty times its count in the output so far, less presence_penalty if that count is above 0
    # (engine/sampler.py's `penalize`; the prompt's tokens are not counted, as OpenAI documents and vLLM does)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: each made token's log-probability and the N most likely others
    # OpenAI's response_format (a ResponseFormat, or its JSON dict): json_object or json_schema constrain the answer
    response_format: ResponseFormat | dict[str, Any] | None = None
    # the compiled grammar of `response_format` (engine/grammar.py's CompiledGrammar): the engine sets it on its own
    # copy of the parameters; the sampler masks each token with it
    grammar: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.response_format, dict):  # validated once, here: a schema can be 32 KiB
            self.response_format = parse_response_format(self.response_format)
        self.check()

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the model's logits as they are (the runner's shortcut): greedy,
        no grammar masks them and no penalty changes them."""
        return self.temperature == 0.0 and self.grammar is None and not self.penalized

    @property
    def penalized(self) -> bool:
        """True when a presence or frequency penalty changes the logits the sampling rule reads."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def output_format(self) -> ResponseFormat | None:
        """The response format that constrains the answer (json_object, json_schema), or None."""
        return parse_response_format(self.response_format)

    def check(self) -> None:
        """Raise EngineInputError naming the first field the sampler cannot honour safely."""
        t = self.temperature
        if not _is_number(t) or not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            _refuse("temperature", f"must be 0 (greedy) or within [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]", t)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _refuse("top_p", "must be within (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            _refuse("top_k", "must be -1 (off), 0 (off) or a positive integer", self.top_k)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                _refuse(name, f"must be a number within [{-MAX_PENALTY}, {MAX_PENALTY}]", value)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _refuse("max_tokens", "must be an integer of at least 1", self.max_tokens)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            _refuse("seed", f"must be an integer within 0..{MAX_SEED}", self.seed)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            _refuse("stop", "must be a list of strings", type(self.stop).__name__)
        if len(self.stop) > MAX_STOP_SEQUENCES:
            _refuse("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", len(self.stop))
        if not all(self.stop):  # it would stop nowhere: refused, not dropped (the detokenizer skips it)
            _refuse("stop", "a stop sequence may not be empty", self.stop)
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            _refuse("stop", f"each stop sequence may have at most {MAX_STOP_CHARS} characters",
                    max(len(s) for s in self.stop))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _refuse("logprobs", f"must be within 0..{MAX_LOGPROBS}", self.logprobs)
        if self.stop and self.output_format is not None:  # wire/chat_request.py's `stop_cuts`, for direct callers
            raise EngineInputError(
                "stop: a stop sequence would cut the JSON/tool call short: the response_format (json_object, "
                "json_schema, or the call schema of a required or named tool_choice) makes the answer JSON, and a stop "
                "string met inside it would end the answer there, unfinished, reading as complete (finish_reason "
                "\"stop\"); remove stop, or the format", param="stop", code="unsupported_value")
        if self.output_format is not None and self.ignore_eos:
            _refuse("response_format", "cannot be combined with ignore_eos (the answer ends where its JSON does)",
                    self.ignore_eos)


def parse_response_format(value: Any) -> ResponseFormat | None:
    """`value` (a ResponseFormat or its JSON dict) as the format that constrains the answer, None for none or
    text; EngineInputError naming `response_format` when it is not one of OpenAI's shapes within wire's bounds."""
    if value is None:
        return None
    try:
        fmt = value if isinstance(value, ResponseFormat) else ResponseFormat.model_validate(value)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in ("response_format", *err["loc"]))
        raise EngineInputError(f"{where}: {err['msg']}", param="response_format") from None
    return fmt if fmt.constrains else None


def _is_number(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse(param: str, rule: str, value: object) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:40] + "…"
    raise EngineInputError(f"{param} {rule} (got {shown})", param=param)
