"""Hand a thread's idle OpenMP worker pool back, so the engine loop's pool spins instead of sleeping.

torch runs its CPU ops on OpenMP (GNU libgomp here). Each thread that starts parallel work gets its own
pool of worker threads, kept for the thread's lifetime. When the model is loaded on the main thread and then
stepped on the engine's loop thread, the process holds two pools; libgomp then counts more threads than CPUs
and stops busy-waiting between parallel regions, so every one of the hundreds of regions in a decode step
wakes its workers through the kernel. Freeing the main thread's pool first makes a decode step on a second
thread 8-9% faster on this 2-core machine (`python -m bench.engine_ablations`). `release_thread_pool` does that
(OpenMP 5's omp_pause_resource_all, soft); where libgomp is not the OpenMP in use (another platform, Intel's
runtime) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger("tiergate.engine")
OMP_PAUSE_SOFT = 1


def _libgomps() -> tuple[ctypes.CDLL, ...]:
    """Every libgomp loaded in this process: torch's, and the copies other wheels bundle (faiss's), each with
    its own pools."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line and line.split()[-1].startswith("/")}
    libs = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all  # noqa: B018 (OpenMP 5.0; older libgomp lacks it)
            libs.append(lib)
        except (OSError, AttributeError):
            continue
    return tuple(libs)


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP workers in every libgomp (they come back if it runs parallel work
    again); False where there is no libgomp to ask."""
    libs = _libgomps()
    codes = [lib.omp_pause_resource_all(OMP_PAUSE_SOFT) for lib in libs]
    if any(codes):
        log.debug("omp_pause_resource_all returned %s", codes)
    return bool(libs) and not any(codes)
