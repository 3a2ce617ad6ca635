"""Model-free stand-ins for engine tests: a character tokenizer and a runner with scripted tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.scheduler_output import SchedulerOutput
from wire.errors import RESPONSE_FORMAT_FAILED

EOS = 0
VOCAB = 128


class CharTokenizer:
    """Token id = code point (ASCII); id 0 is end-of-sequence."""

    chat_template = "char"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(VOCAB)}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ">"


class ScriptedRunner:
    """Answers every prompt with `reply`, then EOS; records which requests started, in order.

    It speaks the model runner's interface (`run(scheduler_output) -> sampled token ids`) over a small
    paged cache, so the real scheduler and block manager run under it.
    """

    def __init__(self, reply: str = "Paris is the capital.", max_model_len: int = 256, step_s: float = 0.0,
                 num_kv_blocks: int = 64, block_size: int = 16) -> None:
        self.reply = [ord(c) for c in reply] + [EOS]
        self.max_model_len = max_model_len
        self.eos_token_ids = {EOS}
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.step_s = step_s
        self.order: list[str] = []  # request ids in the order their first step ran
        self.released: list[str] = []
        self.steps: list[SchedulerOutput] = []
        self.last_logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = {}
        self.last_errors: dict[str, str] = {}
        self.last_error_codes: dict[str, str] = {}
        self.last_grammar_limits: set[str] = set()

    def run(self, out: SchedulerOutput) -> list[int]:
        if self.step_s:
            time.sleep(self.step_s)
        self.steps.append(out)
        made = []
        self.last_logprobs = {}
        for seq, do_sample in zip(out.seqs, out.do_sample, strict=True):
            if seq.request_id not in self.order:
                self.order.append(seq.request_id)
            if do_sample:
                made.append(self.reply[min(seq.num_output_tokens, len(self.reply) - 1)])
                if seq.params.logprobs is not None:  # the scripted token is sure; its neighbour less so
                    top = [(made[-1], -0.25), (made[-1] + 1, -1.5)][: seq.params.logprobs]
                    self.last_logprobs[seq.request_id] = (-0.25, top)
        return made

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def collect(outputs: Any) -> Any:
    """Drain an async iterator of RequestOutput into (text, last output)."""

    async def run() -> tuple[str, Any]:
        text, last = "", None
        async for out in outputs:
            text += out.text
            last = out
        return text, last

    return run()


class FaultyRunner(ScriptedRunner):
    """A ScriptedRunner that fails on cue, found in the prompt's text: `SAMPLE-FAIL` makes that sequence's
    sampling fail (as the model runner reports it: token -1 and `last_errors`), `GRAMMAR-FAIL` the same with
    the request's own error code (a response_format that cannot go on), `FORWARD-FAIL` makes the whole forward
    pass of any step holding that sequence raise."""

    def run(self, out: SchedulerOutput) -> list[int]:
        if any("FORWARD-FAIL" in prompt_text(seq) for seq in out.seqs):
            raise RuntimeError("the forward pass failed")
        made = super().run(out)
        self.last_errors = {}
        self.last_error_codes = {}
        self.last_grammar_limits = set()
        sampled = [seq for seq, do_sample in zip(out.seqs, out.do_sample, strict=True) if do_sample]
        for k, seq in enumerate(sampled):
            if "SAMPLE-FAIL" in prompt_text(seq):
                made[k] = -1
                self.last_errors[seq.request_id] = "RuntimeError: sampling failed"
            if "GRAMMAR-FAIL" in prompt_text(seq):  # as the runner reports a response_format that cannot go on
                made[k] = -1
                self.last_errors[seq.request_id] = "GrammarError: the response_format grammar failed"
                self.last_error_codes[seq.request_id] = RESPONSE_FORMAT_FAILED
            if "GRAMMAR-LIMIT" in prompt_text(seq):  # ... because the grammar ran past its limits
                made[k] = -1
                self.last_errors[seq.request_id] = "GrammarLimitError: the response_format grammar failed: 3999 items"
                self.last_error_codes[seq.request_id] = RESPONSE_FORMAT_FAILED
                self.last_grammar_limits.add(seq.request_id)
        return made


def prompt_text(seq: Any) -> str:
    return "".join(chr(i) for i in seq.prompt_token_ids)


@contextmanager
def serving(eng: Any) -> Iterator[str]:
    """The engine's HTTP server (model "tiny") on `eng`, started; yields its URL, then stops both."""
    from engine.server import create_engine_app
    from tests.stubs import ServerThread

    eng.start()
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    try:
        yield server.url
    finally:
        server.stop()
        eng.shutdown()


@contextmanager
def scripted_server(runner: ScriptedRunner) -> Iterator[str]:
    """The engine's HTTP server (model "tiny") on `runner` and a CharTokenizer; yields its URL, then stops both."""
    from engine.llm_engine import LLMEngine

    with serving(LLMEngine(runner, CharTokenizer())) as url:
        yield url
