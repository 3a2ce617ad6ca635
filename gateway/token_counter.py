"""Prompt token counts at admission, from the tier model's own tokenizer and chat template, without torch.

The `tokenizers` library reads `tokenizer.json`; the chat template is rendered with jinja2 the way
transformers renders it (sandboxed, trim_blocks, lstrip_blocks), so the count equals what the engine
will see. Loaded once per model directory.

Counting reads tenant text, so it is bounded and kept off the event loop's GIL:
- `max_token_chars` is the longest token of the vocabulary in characters: a text longer than
  `limit * max_token_chars` cannot fit in `limit` tokens, so it is refused without being read;
- `encode_batch` is the call of `tokenizers` that releases the GIL while it works (`encode` holds it), so
  the callers run counts in a worker thread and the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

Messages = Sequence[dict[str, Any]]
SHORT_TEXT_CHARS = 8192  # counted with `encode` (GIL held, no hand-off); longer ones with `encode_batch`
RECENT_PROMPTS = 4096  # short prompts whose counts are remembered


class TokenCounter:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template_file = model_dir / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if not source:
            raise ValueError(f"{model_dir} has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        self.template = env.from_string(source)
        self.special = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        # a vocabulary entry's length bounds the characters one token covers: byte-level entries spell one
        # symbol per byte, and a character is at least one byte
        self.max_token_chars = max(1, max(map(len, self.tokenizer.get_vocab(with_added_tokens=True))))
        self._overhead: dict[str, int] = {}
        self._recent: dict[str, int] = {}  # short rendered prompts -> tokens, oldest first
        self._lock = threading.Lock()

    def render(self, messages: Messages) -> str:
        return self.template.render(messages=list(messages), add_generation_prompt=True, **self.special)

    def count(self, text: str) -> int:
        """Tokens of `text`. A long text goes through `encode_batch`, which releases the GIL while it works (a
        worker thread's count then lets the event loop run); a short one through `encode`, which holds the GIL
        for microseconds and skips the batch call's thread-pool hand-off."""
        if len(text) <= SHORT_TEXT_CHARS:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def prompt_tokens(self, messages: Messages) -> int:
        text = self.render(messages)
        if len(text) > SHORT_TEXT_CHARS:
            return self.count(text)
        counted = self._recent.get(text)
        if counted is None:  # a repeated prompt (a retry, a shared system prompt and question) is counted once
            counted = self.count(text)
            with self._lock:  # worker threads count too
                self._recent[text] = counted
                if len(self._recent) > RECENT_PROMPTS:
                    del self._recent[next(iter(self._recent))]
        return counted

    def content_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text, in one call."""
        return [len(e.ids) for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def message_overhead(self, role: str) -> int:
        """Tokens the template adds around one more message of `role` (its markers and role name)."""
        if role not in self._overhead:
            one = [{"role": "user", "content": "x"}]
            two = [*one, {"role": role, "content": "x"}]
            self._overhead[role] = max(0, self.prompt_tokens(two) - self.prompt_tokens(one) - self.count("x"))
        return self._overhead[role]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def token_counter(model_dir: Path) -> TokenCounter:
    return TokenCounter(model_dir)
