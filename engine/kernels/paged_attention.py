"""Loads the paged decode-attention kernel (paged_decode_attention.cpp), compiling it once per machine.

torch.utils.cpp_extension builds it with the machine's C++ compiler and ninja into torch's extension
cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR); about a minute on two cores, once. Builds
are serialized by our own lock (released by the OS if a build is killed), so torch's lock file, which
an interrupted build leaves behind and later builds would wait on forever, can be cleared safely.
Where no compiler is available, the build fails, or TIERGATE_NATIVE_KERNELS=0, `load` returns None and
decode attention gathers each context and calls torch's SDPA instead (same results, slower).
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("tiergate.engine")

NAME = "tiergate_paged_attention"
SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # built where it runs, so native is safe


@cache
def load() -> Any | None:
    """The compiled module (with `paged_decode_attention`), or None where it cannot be built."""
    if os.environ.get("TIERGATE_NATIVE_KERNELS", "1") == "0":
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: decode attention uses the slower gather + SDPA path")
        return None
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    from engine.model_source import file_lock

    log.info("loading the native paged-attention kernel (its first use on a machine compiles it: about a minute)")
    try:
        build_dir = Path(_get_build_directory(NAME, verbose=False))
        with file_lock(build_dir.parent / f"{NAME}.build-lock"):
            (build_dir / "lock").unlink(missing_ok=True)  # only an interrupted build can have left it
            return load_inline(name=NAME, cpp_sources=SOURCE.read_text(), functions=["paged_decode_attention"],
                               extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                               verbose=False)
    except Exception as exc:  # a broken toolchain must not take the engine down: the torch path is correct
        log.warning("could not build the paged attention kernel (%s): using the gather + SDPA path", exc)
        return None
