"""Loads the engine's native CPU kernels, compiling them once per machine: decode attention over the paged
cache (paged_decode_attention.cpp), the fused steps between a layer's matmuls (layer_ops.cpp) and the
per-token steps around the int8 tier's matmuls (int8_rows.cpp), and every layer of a decode-only step in one call
(decode_layers.cpp, which calls the others: the sources are one translation unit, bound in bindings.cpp; the
fp32/bf16 row conversions of bf16_rows.cpp come first).

torch.utils.cpp_extension builds it with the machine's C++ compiler and ninja into torch's extension
cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR); about a minute on two cores, once. Builds
are serialized by our own lock (released by the OS if a build is killed), so torch's lock file, which
an interrupted build leaves behind and later builds would wait on forever, can be cleared safely.
Where no compiler is available, the build fails, or TIERGATE_NATIVE_KERNELS=0, `load` returns None: decode
attention gathers each context and calls torch's SDPA, and the layer steps run as torch ops (engine/layer_ops.py),
with the same results, slower.
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("tiergate.engine")

NAME = "tiergate_cpu_kernels"
SOURCES = [Path(__file__).with_name(name)  # decode_layers.cpp calls the others; bindings.cpp names them all
           for name in ("bf16_rows.cpp", "paged_decode_attention.cpp", "layer_ops.cpp", "int8_rows.cpp",
                        "decode_layers.cpp", "bindings.cpp")]
FUNCTIONS = ["paged_decode_attention", "paged_decode_attention_bf16", "rms_norm", "rms_norm_bf16", "add_rms_norm",
             "add_rms_norm_bf16", "rope_write_kv", "silu_mul", "silu_mul_bf16", "int8_rows_prepare",
             "int8_rows_finish_", "DecodeLayers"]  # bound in bindings.cpp
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # built where it runs, so native is safe


@cache
def load() -> Any | None:
    """The compiled module (with FUNCTIONS), or None where it cannot be built."""
    if os.environ.get("TIERGATE_NATIVE_KERNELS", "1") == "0":
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: the engine uses torch's slower attention and layer ops")
        return None
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    from assets.locks import file_lock

    log.info("loading the native CPU kernels (their first use on a machine compiles them: a minute or two)")
    try:
        build_dir = Path(_get_build_directory(NAME, verbose=False))
        with file_lock(build_dir.parent / f"{NAME}.build-lock"):
            (build_dir / "lock").unlink(missing_ok=True)  # only an interrupted build can have left it
            module = load_inline(name=NAME, cpp_sources=[p.read_text() for p in SOURCES],
                                 extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                                 verbose=False)
        missing = [f for f in FUNCTIONS if not hasattr(module, f)]
        if missing:
            raise RuntimeError(f"the built module lacks {', '.join(missing)}")
        return module
    except Exception as exc:  # a broken toolchain must not take the engine down: the torch path is correct
        log.warning("could not build the native CPU kernels (%s): using torch's attention and layer ops", exc)
        return None
