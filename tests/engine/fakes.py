"""Model-free stand-ins for engine tests: a character tokenizer and a runner with scripted logits."""

from __future__ import annotations

from typing import Any

import torch

from engine.sequence import Sequence

EOS = 0
VOCAB = 128


class CharTokenizer:
    """Token id = code point (ASCII); id 0 is end-of-sequence."""

    chat_template = "char"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ">"


class ScriptedRunner:
    """Answers every prompt with `reply`, then EOS; counts prefill, decode and free calls."""

    def __init__(self, reply: str = "Paris is the capital.", max_model_len: int = 256, step_s: float = 0.0) -> None:
        self.reply = [ord(c) for c in reply] + [EOS]
        self.max_model_len = max_model_len
        self.eos_token_ids = {EOS}
        self.step_s = step_s
        self.freed: list[str] = []
        self.order: list[str] = []

    def _logits(self, seq: Sequence) -> torch.Tensor:
        import time

        if self.step_s:
            time.sleep(self.step_s)
        n = seq.num_output_tokens
        logits = torch.zeros(VOCAB)
        logits[self.reply[min(n, len(self.reply) - 1)]] = 10.0
        return logits

    def prefill(self, seq: Sequence) -> torch.Tensor:
        seq.kv_state = object()
        self.order.append(seq.request_id)
        return self._logits(seq)

    def decode(self, seq: Sequence) -> torch.Tensor:
        return self._logits(seq)

    def free(self, seq: Sequence) -> None:
        seq.kv_state = None
        self.freed.append(seq.request_id)


def collect(outputs: Any) -> Any:
    """Drain an async iterator of RequestOutput into (text, last output)."""

    async def run() -> tuple[str, Any]:
        text, last = "", None
        async for out in outputs:
            text += out.text
            last = out
        return text, last

    return run()
