"""Distil a student from a teacher: match the teacher's next-token distribution on ShareGPT text.

Loss per position: KL(teacher ‖ student) at a temperature (× T²), optionally mixed with cross-entropy
toward the teacher's greedy (argmax) next token. What a CPU step costs, and what this does about it:
- the teacher's forward is the biggest part: the student's first layers are the teacher's, frozen, so that
  pass is run once for both;
- the tied 49,152 × 576 embedding/head is frozen (no weight gradient, no AdamW state for 28M values);
  only the student's own layers and final norm learn;
- the head's softmax over 49,152 tokens is done once per model per step, in one fused log_softmax each.
The run stops at a time budget (training-loop wall time, summed over resumes) or a step count, saves a
checkpoint every `checkpoint_every_s` and at the end, and resumes from it. With a step budget the result
is a pure function of the seed; with a time budget the number of steps depends on the machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from assets import offline_hub
from assets.atomic_file import replacing
from assets.builds import work_dir_for
from assets.torch_device import device_problem
from training.model_card import PROVENANCE, render

log = logging.getLogger("tiergate.distill")
TEACHER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json")


@dataclass(frozen=True)
class DistillConfig:
    layers: int = 8
    keep: tuple[int, ...] | None = None  # teacher layers to start from [default: layer_subset]
    frozen_prefix: int = 3  # the student's first layers stay the teacher's (shared compute)
    budget_s: float | None = 600.0
    steps: int | None = None
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 2e-3
    warmup_steps: int = 4
    temperature: float = 1.0
    greedy_weight: float = 0.8
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    checkpoint_every_s: float = 60.0

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it (budgets may grow)."""
        out = asdict(self)
        for k in ("budget_s", "steps", "device", "threads", "checkpoint_every_s"):
            out.pop(k)
        return out


@dataclass
class DistillResult:
    out_dir: Path
    steps: int
    tokens: int
    train_s: float
    final_loss: float
    keep: list[int]
    history: list[dict[str, float]] = field(default_factory=list)


class DistillError(ValueError):
    """Bad arguments or an incompatible checkpoint; nothing was written."""


def check_device(name: str) -> Any:
    """The torch device `name` names: cpu, or cuda[:N] where this torch sees that GPU (assets/torch_device.py, the
    CLI's rule too). Anything else is a DistillError naming it, before any work: torch's own error came later, from
    deep in loading the teacher (or, for a device type it does not know, as a RuntimeError)."""
    if (problem := device_problem(name)) is not None:
        raise DistillError(f"device {name!r}: {problem}")
    import torch

    return torch.device(name)


def distill(teacher_dir: Path, out_dir: Path, config: DistillConfig, *, work_dir: Path | None = None,
            progress: bool = True, restart: bool = False,
            on_step: Callable[[int, dict[str, float]], None] | None = None,
            describe: Callable[[Any, Any, list[int]], dict[str, Any]] | None = None,
            extra: dict[str, Any] | None = None) -> DistillResult:
    """Train a student of `teacher_dir` into `out_dir` (written atomically at the end, with its model card).

    `describe(teacher, student, keep)` runs before the student is written and returns what the model card
    adds (its measured quality); `extra` goes into the provenance file as given.
    """
    offline_hub()
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.distill_data import TrainingWindows
    from training.student import embed, head, layer_subset, make_student, run_layers

    device = check_device(config.device)
    if config.budget_s is None and config.steps is None:
        raise DistillError("give a budget: a time (--budget 10m) or a number of steps (--budget 500steps)")
    if config.threads:
        torch.set_num_threads(config.threads)
    work_dir = work_dir or work_dir_for(out_dir)
    ckpt_path = work_dir / "checkpoint.pt"
    if restart and ckpt_path.exists():
        ckpt_path.unlink()

    torch.manual_seed(config.seed)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    n_teacher = len(teacher.model.layers)
    keep = list(config.keep) if config.keep else layer_subset(n_teacher, config.layers, prefix=config.frozen_prefix)
    if len(keep) != config.layers:
        raise DistillError(f"--keep names {len(keep)} layers but --layers is {config.layers}")
    prefix = min(config.frozen_prefix, len(keep) - 1)  # at least one layer learns
    if keep[:prefix] != list(range(prefix)):
        raise DistillError(f"a frozen prefix of {prefix} needs the student to start with teacher layers "
                           f"0..{prefix - 1}")
    try:
        student = make_student(teacher, keep).to(device)
    except ValueError as exc:
        raise DistillError(str(exc)) from exc
    for p in teacher.parameters():
        p.requires_grad_(False)
    for p in student.parameters():
        p.requires_grad_(False)
    trainable = [*student.model.layers[prefix:].parameters(), *student.model.norm.parameters()]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
    windows = TrainingWindows(tokenizer, seq_len=config.seq_len, seed=config.seed)

    step, train_s, total_steps, history = 0, 0.0, config.steps, []
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        if state["identity"] != config.identity() or state["teacher"] != str(teacher_dir):
            raise DistillError(f"{ckpt_path} is from another run ({state['identity']}); "
                               "pass --restart to discard it or use the same settings")
        student.load_state_dict(state["student"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step, train_s, history = state["step"], state["train_s"], state["history"]
        total_steps = config.steps or state["total_steps"]
        windows.skip(state["windows"])
        torch.set_rng_state(state["rng"])
        log.info("resumed %s at step %d (%.0fs trained)", ckpt_path, step, train_s)

    def save_checkpoint() -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        own = {k: v for k, v in student.state_dict().items() if _is_trainable_key(k, prefix)}
        with replacing(ckpt_path, mode=0o644) as tmp:  # a resume finds the last one whole; as readable as before
            torch.save({"identity": config.identity(), "teacher": str(teacher_dir), "student": own,
                        "optimizer": optimizer.state_dict(), "step": step, "train_s": train_s,
                        "total_steps": total_steps, "history": history, "windows": windows.used,
                        "rng": torch.get_rng_state()}, tmp)

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    T = config.temperature
    bar = tqdm(total=config.steps if config.steps else int(config.budget_s or 0), initial=0, disable=not progress,
               desc="distilling", unit="step" if config.steps else "s", dynamic_ncols=True)
    bar.update(step if config.steps else int(train_s))
    last_ckpt = time.monotonic()
    student.train()
    while not _done(config, step, train_s):
        t0 = time.perf_counter()
        ids = windows.batch(config.batch_size).to(device)
        with autocast:
            with torch.no_grad():
                h, rope = embed(teacher, ids)
                h = run_layers(teacher.model.layers[:prefix], h, rope)
                t_logits = head(teacher, run_layers(teacher.model.layers[prefix:], h, rope)).float()
                t_logp = torch.log_softmax(t_logits / T, dim=-1)
                t_top1 = t_logits.argmax(-1)
                del t_logits
            s_logits = head(student, run_layers(student.model.layers[prefix:], h, rope)).float()
        s_logp = torch.log_softmax(s_logits / T, dim=-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean() * T * T
        loss = kl
        if config.greedy_weight:
            ce = torch.nn.functional.cross_entropy(s_logits.flatten(0, 1), t_top1.flatten())
            loss = (1 - config.greedy_weight) * kl + config.greedy_weight * ce
        lr = _lr(config, step, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        agree = (s_logits.argmax(-1) == t_top1).float().mean().item()
        step += 1
        dt = time.perf_counter() - t0
        train_s += dt
        if total_steps is None and step == config.warmup_steps:
            # a time budget: fix the schedule's length from the measured step time, once
            total_steps = max(step + 1, int((config.budget_s or 0) / (train_s / step)))
        record = {"step": step, "loss": loss.item(), "kl": kl.item(), "agree": agree, "lr": lr, "train_s": train_s}
        history.append(record)
        bar.set_postfix(step=step, kl=f"{kl.item():.3f}", top1=f"{agree:.1%}", lr=f"{lr:.1e}")
        bar.update(1 if config.steps else int(train_s) - bar.n)
        if time.monotonic() - last_ckpt >= config.checkpoint_every_s:
            save_checkpoint()
            last_ckpt = time.monotonic()
        if on_step:
            on_step(step, record)
    bar.close()
    save_checkpoint()
    info = {"name": out_dir.name, "teacher": str(teacher_dir), "keep": keep, "steps": step,
            "tokens": step * config.batch_size * config.seq_len, "train_s": round(train_s, 1),
            "config": asdict(config), "device": str(device), "final_kl": history[-1]["kl"] if history else None,
            **(extra or {})}
    if describe:
        info.update(describe(teacher, student, keep))
    _save_student(student, teacher_dir, out_dir, info)
    return DistillResult(out_dir, step, step * config.batch_size * config.seq_len, train_s,
                         history[-1]["loss"] if history else math.nan, keep, history)


def _is_trainable_key(key: str, prefix: int) -> bool:
    if key.startswith("model.norm."):
        return True
    if key.startswith("model.layers."):
        return int(key.split(".")[2]) >= prefix
    return False


def _done(config: DistillConfig, step: int, train_s: float) -> bool:
    if config.steps is not None and step >= config.steps:
        return True
    return config.budget_s is not None and train_s >= config.budget_s


def _lr(config: DistillConfig, step: int, total_steps: int | None) -> float:
    """Linear warm-up, then cosine down to a tenth over the (estimated) number of steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if not total_steps:
        return config.lr
    frac = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _save_student(student: Any, teacher_dir: Path, out_dir: Path, provenance: dict[str, Any]) -> None:
    """Write a normal model directory next to `out_dir` and rename it into place (readers never see half)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    student.eval()
    student.save_pretrained(staging, safe_serialization=True)
    for name in TEACHER_FILES:
        if (teacher_dir / name).is_file():
            shutil.copy2(teacher_dir / name, staging / name)
    (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2))
    (staging / "README.md").write_text(render(provenance))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)

