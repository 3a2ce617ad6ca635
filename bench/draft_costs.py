"""The speculative decoder's costs per step, what engine/draft_cost.py's constants come from.

`.venv/bin/python -m bench.draft_costs [CONTEXT ...] [--batches 1,2,4,8,16,32]` (default contexts 64 256 512 1024
1550). The `full` tier's target (SmolLM2-135M-Instruct, dtype auto) and its draft (the same model int8, the `mid`
tier's), one torch thread, median of 5: at each context c, the target's plain decode step D(c) of one sequence, its
k + 1 = 5 verification rows (ModelRunner.logits_of_rows), one single-row draft round, the draft's catch-up rows (128
in one call, per row), and a sampled token's distribution (T=0.8, top_p=0.95) on the logits of README.md's text.

Then a batch's step at a short context (BATCH_CONTEXT tokens each), in D0 (the plain step of one sequence there, the
kinds measured in turn within each repetition so that a busy machine slows them alike): for B sequences, their plain
decode step, a draft round of one row each, and the target's step of 5B rows (their verification at k = 4), and of B
rows; engine/draft_cost.py's batch tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from assets import offline_hub
from bench.engine import MODEL_DIR
from bench.ledger_stores import cpu_model

offline_hub()
ROOT = Path(__file__).resolve().parents[1]
BATCH_CONTEXT = 64


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

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("contexts", nargs="*", type=int, default=[64, 256, 512, 1024, 1550])
    ap.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes of the batch table (none: '')")
    args = ap.parse_args()
    torch.set_num_threads(1)
    draft = ModelRunner(MODEL_DIR, dtype="auto", quantize="int8", kv_cache_bytes=128 << 20)
    target = ModelRunner(MODEL_DIR, dtype="auto")
    params = SamplingParams(temperature=0, max_tokens=16)

    def sequence(runner: ModelRunner, c: int, n: int, blocks: BlockManager | None = None, i: int = 0) -> Sequence:
        blocks = blocks or BlockManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=False)
        seq = Sequence(f"s{i}", [(j * 7 + i) % 40000 + 10 for j in range(c + n)], params)
        assert blocks.allocate_slots(seq, c + n)
        return seq

    print(f"CPU: {cpu_model()}; target {target.dtype}, draft int8 ({draft.dtype} activations), 1 thread\n")
    print("| context | plain decode D | 5 verification rows | one draft row | a catch-up row (128 a call) |\n"
          "|---|---|---|---|---|")
    for c in args.contexts:
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
    gen = Sampler().generator("bench", sampled)  # the seeded request's own generator
    times = []
    for row_logits in logits:
        t0 = time.perf_counter()
        Sampler.draw(Sampler.distribution(row_logits, sampled), gen)
        times.append(time.perf_counter() - t0)
    print(f"\na sampled token (T=0.8, top_p=0.95), 100 rows: median {1e3 * statistics.median(times):.2f} ms, "
          f"mean {1e3 * statistics.mean(times):.2f} ms")
    if args.batches:
        batch_table([int(b) for b in args.batches.split(",")], target, draft, sequence)


def batch_table(batches: list[int], target: Any, draft: Any, sequence: Callable[..., Any]) -> None:
    """A batch's plain step, draft round and verification rows at BATCH_CONTEXT, in D0 (see the module docstring)."""
    from engine.block_manager import BlockManager
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence

    c = BATCH_CONTEXT

    def seqs(runner: Any, n: int) -> list[Any]:
        blocks = BlockManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=False)
        return [sequence(runner, c, 8, blocks, i) for i in range(n)]

    def step(ss: list[Any]) -> SchedulerOutput:
        ones = []
        for s in ss:  # each at its last prompt token: one decode row
            one = Sequence(s.request_id, s.token_ids[:c + 1], s.params)
            one.block_table, one.num_computed_tokens = s.block_table, c
            ones.append(one)
        return SchedulerOutput(ones, [1] * len(ones), [True] * len(ones))

    def rows(ss: list[Any], per_seq: int) -> tuple[list[int], list[int], list[list[int]], list[int]]:
        tokens, positions, tables = [], [], []
        for s in ss:
            tokens += s.token_ids[c:c + per_seq]
            positions += range(c, c + per_seq)
            tables += [s.block_table] * per_seq
        return tokens, positions, tables, list(range(len(tokens)))

    ts, ds = seqs(target, max(batches)), seqs(draft, max(batches))
    one = step(ts[:1])
    print(f"\na batch's step at {c} tokens of context each, in D0 (a plain step of one sequence), median of 5:\n\n"
          "| sequences B | plain step | draft round (B rows) | target, B rows | target, 5B rows (k = 4) |\n"
          "|---|---|---|---|---|")
    for b in batches:
        plain, verify, verify1, round_ = step(ts[:b]), rows(ts[:b], 5), rows(ts[:b], 1), rows(ds[:b], 1)
        calls = {"d0": lambda: target.run(one), "plain": lambda: target.run(plain),  # noqa: B023
                 "draft": lambda: draft.logits_of_rows(*round_),  # noqa: B023
                 "rows": lambda: target.logits_of_rows(*verify1),  # noqa: B023
                 "verify": lambda: target.logits_of_rows(*verify)}  # noqa: B023
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(5):  # in turn: a busy machine slows every kind alike
            for name, call in calls.items():
                times[name].append(median_s(call, 1))
        d0 = statistics.median(times["d0"])
        r = {name: statistics.median(t) / d0 for name, t in times.items()}
        print(f"| {b} | {r['plain']:.2f} | {r['draft']:.2f} | {r['rows']:.2f} | {r['verify']:.2f} |  (D0 "
              f"{1e3 * d0:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
