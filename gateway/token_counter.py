"""Prompt token counts at admission, from the tier model's own tokenizer and chat template, without torch.

The `tokenizers` library reads `tokenizer.json`; the chat template is rendered with jinja2 the way
transformers renders it (sandboxed, trim_blocks, lstrip_blocks), so the count equals what the engine
will see. Loaded once per model directory.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


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

    def prompt_tokens(self, messages: list[dict[str, Any]]) -> int:
        text = self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def token_counter(model_dir: Path) -> TokenCounter:
    return TokenCounter(model_dir)
