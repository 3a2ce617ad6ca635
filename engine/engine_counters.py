"""`EngineCounters`: the engine's running totals and its recent throughput, and the `EngineStats` snapshot made of
them with the scheduler's and the block manager's own counts (what /metrics and /health show).

The engine's loop thread alone writes them. `snapshot` takes no lock: it reads counters, container lengths and a
published throughput, each one attribute or `len()` read, which the GIL makes atomic; the numbers of one snapshot may
come from two neighbouring steps, which is consistent enough for gauges and means /health never waits on a step
however slow it is.
"""

from __future__ import annotations

import time
from collections import deque

from engine.block_manager import BlockManager
from engine.outputs import EngineStats
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.speculative import SpeculativeDecoder

THROUGHPUT_WINDOW_S = 10.0  # tokens/s in stats is measured over this trailing window


class EngineCounters:
    """Totals since the engine started, named as `EngineStats` names them, and tokens/s over the last
    THROUGHPUT_WINDOW_S."""

    def __init__(self) -> None:
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.busy_s_total = 0.0
        self.num_requests_finished = 0
        self.num_requests_failed = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens made) per step, for tokens/s
        self._recent_tokens = 0  # sum of the tokens in `_recent`
        self.generation_tokens_per_s = 0.0  # published for `snapshot` after each step and each idle wake

    def account(self, out: SchedulerOutput, step_s: float, num_made: int) -> None:
        """Share the step's compute time among its sequences by their tokens (the ledger's compute cost)."""
        total = out.total_num_scheduled_tokens
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            seq.busy_s += step_s * n / total
        self.busy_s_total += step_s
        self.num_generation_tokens_total += num_made
        self.count_made(num_made)

    def count_made(self, num_made: int) -> None:
        """Slide the throughput window and publish tokens/s (one float, read by `snapshot` without a lock)."""
        now = time.monotonic()
        if num_made:
            self._recent.append((now, num_made))
            self._recent_tokens += num_made
        while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent_tokens -= self._recent.popleft()[1]
        self.generation_tokens_per_s = self._recent_tokens / THROUGHPUT_WINDOW_S

    def snapshot(self, scheduler: Scheduler, bm: BlockManager, spec: SpeculativeDecoder | None,
                 num_inbox: int) -> EngineStats:
        """The engine's stats, lock-free (see the module): `num_inbox` requests not handed to the scheduler yet
        count as waiting."""
        num_used = bm.num_used_blocks
        return EngineStats(
            len(scheduler.running), len(scheduler.waiting) + num_inbox,
            self.num_prompt_tokens_total, self.num_generation_tokens_total, self.busy_s_total,
            self.num_requests_finished,
            num_kv_blocks_total=bm.num_blocks, num_kv_blocks_used=num_used,
            num_kv_blocks_free=bm.num_blocks - num_used,
            num_kv_blocks_used_by_others=bm.num_used_blocks_but_largest,
            num_prefix_query_tokens_total=bm.num_prefix_query_tokens,
            num_prefix_hit_tokens_total=bm.num_prefix_hit_tokens,
            num_preemptions_total=scheduler.num_preemptions_total,
            generation_tokens_per_s=self.generation_tokens_per_s,
            num_requests_failed=self.num_requests_failed,
            num_speculative_steps_total=spec.num_steps if spec else 0,
            num_draft_tokens_total=spec.num_draft_tokens if spec else 0,
            num_accepted_draft_tokens_total=spec.num_accepted_tokens if spec else 0,
        )
