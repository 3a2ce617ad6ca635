"""The devices a command may name (`--device`): cpu, or cuda[:N] where this torch sees that GPU. One rule for the
CLI's option (gateway/cli/options.py) and distillation's own check (training/distill.py), said before any work;
torch is imported only for a cuda device."""

from __future__ import annotations

import re

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_problem(name: str) -> str | None:
    """Why `name` is not a device this torch can use; None where it is."""
    if not _DEVICE.fullmatch(name):
        return "neither cpu nor cuda[:N]"
    if name == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return "this torch sees no CUDA device (a CPU-only build, or no GPU or driver); give cpu"
    count, index = torch.cuda.device_count(), int(name.partition(":")[2] or 0)
    if index >= count:
        return f"this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None
