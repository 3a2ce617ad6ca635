"""Hand a thread's idle OpenMP worker pool back, so the engine loop's pool spins instead of sleeping.

torch runs its CPU ops on OpenMP (GNU libgomp here). Each thread that starts parallel work gets its own
pool of worker threads, kept for the thread's lifetime. When the model is loaded on the main thread and then
stepped on the engine's loop thread, the process holds two pools; libgomp then counts more threads than CPUs
and stops busy-waiting between parallel regions, so every one of the hundreds of regions in a decode step
wakes its workers through the kernel. Measured on this 2-core machine, one decode stream: 83 ms a step on
the loop thread against 68 ms on the main thread; freeing the main thread's pool first gives 68 ms on the loop
thread too. `release_thread_pool` does that (OpenMP 5's omp_pause_resource_all, soft); where libgomp is not
the OpenMP in use (another platform, Intel's runtime) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

log = logging.getLogger("tiergate.engine")
OMP_PAUSE_SOFT = 1


@cache
def _libgomp() -> ctypes.CDLL | None:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line and line.split()[-1].startswith("/")}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all  # noqa: B018 (OpenMP 5.0; older libgomp lacks it)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP workers (they come back if it runs parallel work again)."""
    lib = _libgomp()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %s", rc)
    return rc == 0
