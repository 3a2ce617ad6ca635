"""A student built from a subset of a Llama teacher's layers, and the forward pieces distillation runs.

The student keeps the teacher's embeddings, final norm and (tied) head, and copies of `keep` layers. Its
first `frozen_prefix` layers are the teacher's first layers unchanged and frozen, so one pass through them
serves both models (the teacher's forward is most of a training step's cost on a CPU).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def layer_subset(n_teacher: int, n_student: int, *, prefix: int = 2) -> list[int]:
    """The teacher layers a student of `n_student` layers starts from: the first `prefix` (kept frozen, the
    cheapest to share) then the rest spread evenly up to the teacher's last layer."""
    if not 1 <= n_student <= n_teacher:
        raise ValueError(f"a student needs 1..{n_teacher} layers, not {n_student}")
    prefix = min(prefix, n_student - 1)
    rest = n_student - prefix
    span = n_teacher - prefix
    spread = [prefix + round((i + 1) * span / rest) - 1 for i in range(rest)]
    return list(range(prefix)) + spread


def make_student(teacher: nn.Module, keep: list[int]) -> nn.Module:
    """A copy of `teacher` with only the `keep` layers (in that order); embeddings and head shared by value."""
    n = len(teacher.model.layers)
    if not keep or any(not 0 <= i < n for i in keep) or sorted(set(keep)) != list(keep):
        raise ValueError(f"keep must be increasing teacher layer indexes in 0..{n - 1}, got {keep}")
    layers = teacher.model.layers
    teacher.model.layers = nn.ModuleList()  # so deepcopy skips the layers we drop
    try:
        student = copy.deepcopy(teacher)
    finally:
        teacher.model.layers = layers
    student.model.layers = nn.ModuleList(copy.deepcopy(layers[i]) for i in keep)
    for j, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = j
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    return student


def embed(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Token embeddings and the rotary tables for positions 0..T-1."""
    h = model.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return h, model.model.rotary_emb(h, position_ids=positions)


def run_layers(layers: Any, h: torch.Tensor, rope: Any) -> torch.Tensor:
    """Causal self-attention blocks over whole sequences (no cache, no padding: SDPA's causal path)."""
    for layer in layers:
        h = layer(h, attention_mask=None, position_embeddings=rope)
        if isinstance(h, tuple):
            h = h[0]
    return h


def head(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(h))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    h, rope = embed(model, ids)
    return head(model, run_layers(model.model.layers, h, rope))
