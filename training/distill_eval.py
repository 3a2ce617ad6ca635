"""How close a student is to its teacher, teacher-forced on held-out text.

- top-1 agreement: the fraction of positions where the student's most likely next token is the teacher's
  (both see the same real text, so one early mistake does not spoil the rest, unlike free generation);
- perplexity: exp of the mean cross-entropy of the real next token (the text's own, not the teacher's).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from training.student import logits


@torch.no_grad()
def top1_and_nll(model: Any, windows: torch.Tensor, *, chunk: int = 4) -> tuple[torch.Tensor, float]:
    """Each position's argmax next token, and the mean negative log-likelihood of the text's next tokens."""
    model.eval()
    device = next(model.parameters()).device
    tops, nll, n = [], 0.0, 0
    for i in range(0, len(windows), chunk):
        ids = windows[i:i + chunk].to(device)
        out = logits(model, ids).float()
        tops.append(out.argmax(-1).cpu())
        logp = torch.log_softmax(out[:, :-1], dim=-1)
        nll -= logp.gather(-1, ids[:, 1:, None]).sum().item()
        n += ids[:, 1:].numel()
    return torch.cat(tops), nll / n


def compare(model: Any, teacher_top1: torch.Tensor, windows: torch.Tensor) -> dict[str, float]:
    """Agreement with the teacher's top-1 and perplexity on `windows`."""
    top1, nll = top1_and_nll(model, windows)
    return {"top1_agreement": (top1 == teacher_top1).float().mean().item(), "perplexity": math.exp(nll)}
