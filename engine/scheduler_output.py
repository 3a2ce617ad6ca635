"""What the scheduler hands the model runner each step (vLLM v1's `SchedulerOutput`): one dataclass, a comment per
field. Its own module: the runner and the speculative path need only this, not the scheduler's policy
(engine.scheduler re-exports it, where its callers import it from)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    """What the model runner computes in one step."""

    # sequences to run, in batch order
    seqs: list[Sequence] = field(default_factory=list)
    # new tokens per sequence: seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n]
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # per sequence: True when this step reaches its last token, so a next token is sampled from it
    do_sample: list[bool] = field(default_factory=list)
    # sequences whose blocks were taken back this step (they wait to be recomputed)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
