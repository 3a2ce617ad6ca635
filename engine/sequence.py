"""A request inside the engine: its tokens, its sampling parameters, its KV blocks, where it stands."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()  # blocks taken back; recomputed from its tokens when readmitted
    FINISHED = auto()


def salt_tenant(salt: str | None) -> str | None:
    """The tenant of a cache salt: what comes before its first '.'. The gateway salts a plan's isolated end users'
    prompts apart (`<tenant digest>.<end user digest>`), but the scheduler's, block and compile shares stay the
    tenant's: a tenant naming many end users does not take many tenants' shares of the engine."""
    return salt if salt is None else salt.split(".", 1)[0]


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    busy_s: float = 0.0  # engine compute time attributed to this sequence
    # the paged KV cache: block ids in position order, and the prefix hash of each full block
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, tokens found in the prefix cache at admission
    num_preemptions: int = 0
    # the prefix cache's namespace (the gateway's per-tenant salt, or per end user: `salt_tenant`): blocks are shared
    # only between sequences with the same salt, so one tenant cannot time another's prompts out of the cache
    # (engine/block_manager.py)
    cache_salt: str | None = None

    @property
    def tenant(self) -> str | None:
        """Whose share of the engine this sequence takes (`salt_tenant`)."""
        return salt_tenant(self.cache_salt)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True until every token but the one being sampled next has its K/V in the cache."""
        return self.num_tokens - self.num_computed_tokens > 1
