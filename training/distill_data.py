"""Training and held-out text for distillation: ShareGPT conversations through the teacher's chat template.

Conversations are split once, by their index in the file: every `HELDOUT_EVERY`-th one is held out for
measuring (bench/distill.py, the model card), the rest are for training, so no measured text was trained on.
Training windows are `seq_len` tokens cut from the templated conversations concatenated in a seeded order;
the stream is a pure function of (seed, seq_len, tokenizer), so a resumed run skips the windows it already
used and sees exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch

from assets.datasets import sharegpt_conversations

HELDOUT_EVERY = 50
MAX_CONVERSATION_TOKENS = 2048  # longer conversations are cut, so one long chat does not fill whole batches


@cache
def _split() -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = len(_conversations())
    heldout = tuple(i for i in range(n) if i % HELDOUT_EVERY == 0)
    train = tuple(i for i in range(n) if i % HELDOUT_EVERY != 0)
    return train, heldout


@cache
def _conversations() -> list[list[dict[str, str]]]:
    return sharegpt_conversations()


def _templated(tokenizer: Any, index: int) -> list[int]:
    messages = _conversations()[index]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    return list(ids)[:MAX_CONVERSATION_TOKENS]


class TrainingWindows:
    """An endless, seeded stream of [seq_len] token windows from the training conversations."""

    def __init__(self, tokenizer: Any, *, seq_len: int, seed: int) -> None:
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.used = 0  # windows handed out so far (saved in checkpoints)
        self._it = self._windows()

    def _windows(self) -> Iterator[list[int]]:
        train, _ = _split()
        epoch = 0
        buffer: list[int] = []
        while True:
            order = list(train)
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            for index in order:
                buffer += _templated(self.tokenizer, index)
                while len(buffer) >= self.seq_len:
                    yield buffer[: self.seq_len]
                    buffer = buffer[self.seq_len:]
            epoch += 1

    def skip(self, n: int) -> None:
        """Fast-forward past `n` windows (resuming a checkpoint)."""
        for _ in range(n):
            next(self._it)
        self.used += n

    def batch(self, batch_size: int) -> torch.Tensor:
        rows = [next(self._it) for _ in range(batch_size)]
        self.used += batch_size
        return torch.tensor(rows, dtype=torch.long)


def heldout_windows(tokenizer: Any, *, seq_len: int, n_tokens: int) -> torch.Tensor:
    """The first `n_tokens` (rounded down to whole windows) of held-out conversations, as [B, seq_len]."""
    _, heldout = _split()
    rows: list[list[int]] = []
    buffer: list[int] = []
    for index in heldout:
        buffer += _templated(tokenizer, index)
        while len(buffer) >= seq_len and len(rows) * seq_len < n_tokens:
            rows.append(buffer[:seq_len])
            buffer = buffer[seq_len:]
        if len(rows) * seq_len >= n_tokens:
            break
    if not rows:
        raise ValueError("no held-out ShareGPT text")
    return torch.tensor(rows, dtype=torch.long)
