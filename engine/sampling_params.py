"""How a sequence's next token is chosen and when it ends."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means off
    max_tokens: int = 256
    seed: int | None = None  # a seeded request samples the same tokens every time
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: each made token's log-probability and the N most likely others

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
