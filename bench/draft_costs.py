"""The speculative decoder's costs per step, what engine/draft_cost.py's constants come from.

`.venv/bin/python -m bench.draft_costs [CONTEXT ...]` (default 64 256 512 1024 1550). The `full` tier's target
(SmolLM2-135M-Instruct, dtype auto) and its draft (the same model int8, the `mid` tier's), one torch thread, median
of 5: at each context c, the target's plain decode step D(c) of one sequence, its k + 1 = 5 verification rows
(ModelRunner.logits_of_rows), one single-row draft round, the draft's catch-up rows (128 in one call, per row), and a
sampled token's distribution (T=0.8, top_p=0.95) on the logits of README.md's text.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from assets import offline_hub
from bench.engine import MODEL_DIR
from bench.ledger_stores import cpu_model

offline_hub()
ROOT = Path(__file__).resolve().parents[1]


def median_s(f: Callable[[], Any], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    import torch

    from engine.block_manager import BlockManager
    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence

    torch.set_num_threads(1)
    contexts = [int(a) for a in sys.argv[1:]] or [64, 256, 512, 1024, 1550]
    draft = ModelRunner(MODEL_DIR, dtype="auto", quantize="int8", kv_cache_bytes=128 << 20)
    target = ModelRunner(MODEL_DIR, dtype="auto")
    params = SamplingParams(temperature=0, max_tokens=16)

    def sequence(runner: ModelRunner, c: int, n: int) -> Sequence:
        blocks = BlockManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=False)
        seq = Sequence("s", [(i * 7) % 40000 + 10 for i in range(c + n)], params)
        assert blocks.allocate_slots(seq, c + n)
        return seq

    print(f"CPU: {cpu_model()}; target {target.dtype}, draft int8 ({draft.dtype} activations), 1 thread\n")
    print("| context | plain decode D | 5 verification rows | one draft row | a catch-up row (128 a call) |\n"
          "|---|---|---|---|---|")
    for c in contexts:
        s = sequence(target, c, 8)
        one = Sequence("t", s.token_ids[:c + 1], params)
        one.block_table, one.num_computed_tokens = s.block_table, c
        plain = median_s(lambda: target.run(SchedulerOutput([one], [1], [True])))  # noqa: B023
        verify = median_s(lambda: target.logits_of_rows(s.token_ids[c:c + 5], list(range(c, c + 5)),  # noqa: B023
                                                        [s.block_table] * 5, list(range(5))))  # noqa: B023
        d = sequence(draft, c, 8)
        row = median_s(lambda: draft.logits_of_rows([d.token_ids[c]], [c], [d.block_table], [0]))  # noqa: B023
        u = sequence(draft, c, 128)
        catch = median_s(lambda: draft.logits_of_rows(u.token_ids[c:c + 128], list(range(c, c + 128)),  # noqa: B023
                                                      [u.block_table] * 128, [127]), 3) / 128  # noqa: B023
        print(f"| {c:,} | {1e3 * plain:.1f} ms | {1e3 * verify:.1f} ms | {1e3 * row:.1f} ms | {1e3 * catch:.2f} ms |",
              flush=True)
    from transformers import AutoTokenizer

    text_ids = AutoTokenizer.from_pretrained(MODEL_DIR)((ROOT / "README.md").read_text()[:3000])["input_ids"][:200]
    s = sequence(target, 0, len(text_ids))
    logits = target.logits_of_rows(text_ids, list(range(len(text_ids))), [s.block_table] * len(text_ids),
                                   list(range(100, len(text_ids))))
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    gen = torch.Generator().manual_seed(1)
    times = []
    for row_logits in logits:
        t0 = time.perf_counter()
        Sampler.draw(Sampler.distribution(row_logits, sampled), gen)
        times.append(time.perf_counter() - t0)
    print(f"\na sampled token (T=0.8, top_p=0.95), 100 rows: median {1e3 * statistics.median(times):.2f} ms, "
          f"mean {1e3 * statistics.mean(times):.2f} ms")


if __name__ == "__main__":
    main()
