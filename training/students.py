"""Building a tier's model by distillation: what `tiergate models distill` runs (and `tiergate serve`, as a
child process, on first use).

One build per output directory at a time, under assets/builds.py's lock (a second caller is told who holds
it); progress goes where assets/builds.py's `build_progress` reads it, so the gateway can say "preparing:
40%" while it waits. The student is measured on held-out ShareGPT text and the result written into its
model card.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assets.builds import build_lock, parse_budget, work_dir_for, write_progress
from assets.model_source import ModelSourceError, is_model_dir, prepare_model, resolve_model
from tiers.catalogue import TierCatalogue
from training.distill import DistillConfig, check_device, distill

DEFAULT_LAYERS = 8
DEFAULT_BUDGET = "10m"
HELDOUT_TOKENS = 4096


@dataclass(frozen=True)
class StudentRequest:
    teacher: str = "full"
    layers: int | None = None
    budget: str | None = None
    out: Path | None = None
    keep: str | None = None
    frozen_prefix: int = 3
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 2e-3
    temperature: float = 1.0
    greedy_weight: float = 0.8
    seed: int | None = None
    device: str = "cpu"
    threads: int | None = None
    restart: bool = False


def build_student(req: StudentRequest, *, catalogue: TierCatalogue, models_dir: Path,
                  progress: bool = True) -> tuple[Path, str]:
    """Distil, measure and write the student; returns its directory and model card."""
    check_device(req.device)  # as --keep below, before the teacher is prepared (a download of hundreds of MB)
    try:
        keep = tuple(int(x) for x in req.keep.split(",")) if req.keep else None
    except ValueError:
        raise ValueError(f"--keep {req.keep!r}: give teacher layer numbers separated by commas") from None
    tier = catalogue.tiers.get(req.teacher)
    student_tier = catalogue.student_of(req.teacher) if tier else None
    if tier is not None:
        if tier.backend != "local":
            raise ValueError(f"tier {req.teacher!r} is remote; distil from a local tier or a model directory")
        teacher_dir = prepare_model(tier.model, models_dir, progress=progress)
    elif is_model_dir(Path(req.teacher)):
        teacher_dir = Path(req.teacher).resolve()
    else:
        raise ModelSourceError(f"--teacher {req.teacher!r} is neither a tier ({', '.join(catalogue.tiers)}) nor a "
                               "model directory")
    spec = student_tier.distill if student_tier and student_tier.distill else None
    if req.out is not None:
        out = req.out.resolve()
    elif student_tier is not None:
        out = resolve_model(student_tier.model, models_dir)
    else:
        raise ValueError(f"no tier is distilled from {req.teacher!r}; say where to write the student with --out")
    budget = req.budget or (spec.budget if spec else DEFAULT_BUDGET)
    budget_s, steps = parse_budget(budget)
    layers = req.layers or (spec.layers if spec else DEFAULT_LAYERS)
    config = DistillConfig(layers=layers, keep=keep, frozen_prefix=req.frozen_prefix, budget_s=budget_s, steps=steps,
                           batch_size=req.batch_size, seq_len=req.seq_len, lr=req.lr, temperature=req.temperature,
                           greedy_weight=req.greedy_weight, seed=req.seed if req.seed is not None else (
                               spec.seed if spec else 0), device=req.device, threads=req.threads)
    work = work_dir_for(out)

    def on_step(step: int, record: dict[str, float]) -> None:
        if step % 5 == 0 or step == 1:
            write_progress(out, {**record, "budget_s": budget_s, "steps": steps, "at": time.time()})

    with build_lock(out):
        result = distill(teacher_dir, out, config, work_dir=work, progress=progress, restart=req.restart,
                         on_step=on_step, describe=measure_quality,
                         extra={"budget": budget, "teacher_tier": req.teacher if tier else None})
    card = (result.out_dir / "README.md").read_text()
    return result.out_dir, card


def measure_quality(teacher: Any, student: Any, keep: list[int]) -> dict[str, Any]:
    """Agreement and perplexity on held-out ShareGPT text: the student, its untrained start, the teacher."""
    from transformers import AutoTokenizer

    from training.distill_data import heldout_windows
    from training.distill_eval import compare, top1_and_nll
    from training.student import make_student

    tokenizer = AutoTokenizer.from_pretrained(teacher.name_or_path)
    windows = heldout_windows(tokenizer, seq_len=256, n_tokens=HELDOUT_TOKENS)
    teacher_top1, _ = top1_and_nll(teacher, windows)
    quality = {"heldout_tokens": windows.numel(),
               "teacher": compare(teacher, teacher_top1, windows),
               "untrained": compare(make_student(teacher, keep), teacher_top1, windows),
               "student": compare(student, teacher_top1, windows)}
    return {"quality": quality}

