"""Building a tier's model by distillation: what `tiergate models distill` and `tiergate serve` run.

One build per output directory at a time (an exclusive lock next to it; a second caller is told who holds
it); progress goes to `<work dir>/progress.json` so the gateway can say "preparing: 40%" while it waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.distill import DistillConfig, distill, parse_budget
from engine.model_source import ModelSourceError, is_model_dir, prepare_model, resolve_model
from tiers.catalogue import TierCatalogue

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


class BuildInProgress(Exception):
    """Another process is building this model now."""


def work_dir_for(out: Path) -> Path:
    return out.parent / f".{out.name}.work"


def lock_path_for(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold the one-builder lock of `out`, or raise BuildInProgress at once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path_for(out), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise BuildInProgress(f"{out} is being built by process {fh.read().strip() or '?'}") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_building(out: Path) -> bool:
    """Whether some process holds `out`'s build lock now."""
    path = lock_path_for(out)
    if not path.exists():
        return False
    with open(path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def build_progress(out: Path) -> dict[str, Any] | None:
    """The running build's last progress record, if one is running."""
    if not is_building(out):
        return None
    try:
        return json.loads((work_dir_for(out) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def build_student(req: StudentRequest, *, catalogue: TierCatalogue, models_dir: Path,
                  progress: bool = True) -> tuple[Path, str]:
    """Distil, measure and write the student; returns its directory and model card."""
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
    try:
        keep = tuple(int(x) for x in req.keep.split(",")) if req.keep else None
    except ValueError:
        raise ValueError(f"--keep {req.keep!r}: give teacher layer numbers separated by commas") from None
    config = DistillConfig(layers=layers, keep=keep, frozen_prefix=req.frozen_prefix, budget_s=budget_s, steps=steps,
                           batch_size=req.batch_size, seq_len=req.seq_len, lr=req.lr, temperature=req.temperature,
                           greedy_weight=req.greedy_weight, seed=req.seed if req.seed is not None else (
                               spec.seed if spec else 0), device=req.device, threads=req.threads)
    work = work_dir_for(out)

    def on_step(step: int, record: dict[str, float]) -> None:
        if step % 5 == 0 or step == 1:
            _write_progress(work, {**record, "budget_s": budget_s, "steps": steps, "at": time.time()})

    with build_lock(out):
        result = distill(teacher_dir, out, config, work_dir=work, progress=progress, restart=req.restart,
                         on_step=on_step, describe=measure_quality,
                         extra={"budget": budget, "teacher_tier": req.teacher if tier else None})
    card = (result.out_dir / "README.md").read_text()
    return result.out_dir, card


def _write_progress(work: Path, record: dict[str, Any]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / "progress.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(work / "progress.json")


def measure_quality(teacher: Any, student: Any, keep: list[int]) -> dict[str, Any]:
    """Agreement and perplexity on held-out ShareGPT text: the student, its untrained start, the teacher."""
    from transformers import AutoTokenizer

    from engine.distill_data import heldout_windows
    from engine.distill_eval import compare, top1_and_nll
    from engine.student import make_student

    tokenizer = AutoTokenizer.from_pretrained(teacher.name_or_path)
    windows = heldout_windows(tokenizer, seq_len=256, n_tokens=HELDOUT_TOKENS)
    teacher_top1, _ = top1_and_nll(teacher, windows)
    quality = {"heldout_tokens": windows.numel(),
               "teacher": compare(teacher, teacher_top1, windows),
               "untrained": compare(make_student(teacher, keep), teacher_top1, windows),
               "student": compare(student, teacher_top1, windows)}
    return {"quality": quality}

