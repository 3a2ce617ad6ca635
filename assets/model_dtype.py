"""What the `auto` dtype means for a model, decided without torch (the gateway sizes engines' KV caches with it).

`auto` is bf16 on CUDA and on CPUs with fast bf16 (AVX-512 BF16 or AMX), fp32 elsewhere, except for an int8
model on an x86 CPU: its int8 kernels (fbgemm, engine/int8_dynamic.py) take fp32 activations, and under bf16 it
would fall back to weight-only int8 dequantized into every matmul. On the Xeon with AMX this was measured 5x
slower (SmolLM2-135M, one stream: 91 ms a decode step in bf16 against 17 ms with fp32 activations), so the
`mid` tier ran slower than the `full` one it is meant to undercut.
"""

from __future__ import annotations

import platform
from pathlib import Path

X86 = ("x86_64", "amd64", "i386", "i686")


def cpu_has_fast_bf16() -> bool:
    """True where the CPU has AVX-512 BF16 or AMX, the instructions that make bf16 matmuls fast."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_dtype(device: str, quantize: str | None = None) -> str:
    """The name ("bf16" or "fp32") `auto` resolves to for a model on `device` with `quantize`."""
    if device.startswith("cuda"):
        return "bf16"
    if quantize == "int8" and platform.machine().lower() in X86:
        return "fp32"
    return "bf16" if cpu_has_fast_bf16() else "fp32"
