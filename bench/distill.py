"""The distilled student against its untrained start and its teacher, all in one run.

`.venv/bin/python -m bench.distill` (see --help). On held-out ShareGPT text (every 50th conversation, never
trained on), teacher-forced:
- top-1 agreement with the teacher (the student's most likely next token is the teacher's);
- perplexity of the text's own next tokens;
and decode speed through our engine (fp32, EOS ignored, ShareGPT first turns as prompts) at 1 and
--streams concurrent streams, for the student, the same layer subset before training, and the teacher.
The student's model card (README.md) is rewritten with these numbers; paste the printed block into
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from assets import offline_hub

offline_hub()

MODELS = Path.home() / ".local/share/tiergate/models"
COMMAND = "python -m bench.distill"


def speed(model_dir: Path, tok: Any, prompts: list[list[int]], streams: int, output_len: int,
          device: str = "cpu") -> dict[str, float]:
    """Decode tokens/s at 1 and `streams` concurrent streams (the best of two passes each)."""
    from bench.engine import run_engine
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner

    runner = ModelRunner(model_dir, dtype="fp32" if device == "cpu" else "bf16", device=device,
                         kv_cache_bytes=256 << 20)
    engine = LLMEngine(runner, tok, max_num_seqs=streams, max_num_batched_tokens=512)
    engine.start()
    try:
        run_engine(engine, prompts[:1], 4)  # warm-up
        out = {}
        for n in (1, streams):
            out[str(n)] = max(run_engine(engine, prompts[:n], output_len)["decode_tok_s"] for _ in range(2))
        return out
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--student", type=Path, default=MODELS / "students" / "smollm2-small")
    ap.add_argument("--heldout-tokens", type=int, default=8192)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16 for the speed runs)")
    ap.add_argument("--no-card", action="store_true", help="do not rewrite the student's model card")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.engine import load_prompts
    from training.distill_data import heldout_windows
    from training.distill_eval import compare, top1_and_nll
    from training.model_card import PROVENANCE, update
    from training.student import make_student

    torch.set_num_threads(args.threads)
    info = json.loads((args.student / PROVENANCE).read_text())
    teacher_dir = Path(info["teacher"])
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(args.device).eval()
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).to(args.device).eval()
    untrained = make_student(teacher, info["keep"]).eval()

    windows = heldout_windows(tok, seq_len=256, n_tokens=args.heldout_tokens)
    t0 = time.perf_counter()
    teacher_top1, _ = top1_and_nll(teacher, windows)
    quality = {"heldout_tokens": windows.numel(), "teacher": compare(teacher, teacher_top1, windows),
               "untrained": compare(untrained, teacher_top1, windows),
               "student": compare(student, teacher_top1, windows)}
    print(f"quality measured in {time.perf_counter() - t0:.0f}s on {windows.numel()} held-out tokens", flush=True)

    prompts = load_prompts(tok, args.streams, args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        untrained_dir = Path(tmp) / "untrained"
        untrained.save_pretrained(untrained_dir)
        run = {"streams": args.streams, "output_len": args.output_len, "device": args.device}
        speeds = {"this student": speed(args.student, tok, prompts, **run),
                  "same layers before training": speed(untrained_dir, tok, prompts, **run),
                  "teacher (full tier)": speed(teacher_dir, tok, prompts, **run)}
    s, t = speeds["this student"], speeds["teacher (full tier)"]
    cfg = info.get("config", {})
    lines = [
        f"Student `{args.student.name}`: {len(info['keep'])} of the teacher's "
        f"{teacher.config.num_hidden_layers} layers "
        f"({info['keep']}), distilled for {info.get('budget', '?')} ({info['steps']} steps, {info['tokens']:,} tokens, "
        f"{info['train_s']:.0f} s, batch {cfg.get('batch_size')} x {cfg.get('seq_len')}, seed {cfg.get('seed')}).",
        "",
        f"| model | top-1 agreement with teacher | perplexity | decode tok/s, 1 stream | decode tok/s, {args.streams} "
        "streams |",
        "|---|---|---|---|---|",
    ]
    for label, key, sp in (("this student", "student", s), ("same layers before training", "untrained",
                                                            speeds["same layers before training"]),
                           ("teacher (full tier)", "teacher", t)):
        q = quality[key]
        lines.append(f"| {label} | {q['top1_agreement']:.1%} | {q['perplexity']:.1f} | {sp['1']:.1f} | "
                     f"{sp[str(args.streams)]:.1f} |")
    lines += ["", f"Student vs teacher decode speed: {s['1'] / t['1']:.2f}x at 1 stream, "
              f"{s[str(args.streams)] / t[str(args.streams)]:.2f}x at {args.streams} streams "
              f"({quality['heldout_tokens']:,} held-out tokens; threads={args.threads}, prompts <= {args.prompt_len} "
              f"tokens, {args.output_len} output tokens, decoded in {'fp32' if args.device == 'cpu' else 'bf16'} "
              f"on {args.device}).",
              f"Reproduce: `{COMMAND} --streams {args.streams} --threads {args.threads} --device {args.device}`"]
    print("\n".join(lines))
    if not args.no_card:
        update(args.student, quality=quality, speed={k: {"1": v["1"], "16": v[str(args.streams)]}
                                                     for k, v in speeds.items()},
               bench_command=f"{COMMAND} --streams {args.streams} --threads {args.threads}")
        print(f"\nmodel card updated: {args.student / 'README.md'}")


if __name__ == "__main__":
    main()
