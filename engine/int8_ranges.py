"""The int8 tier's calibrated activation ranges, computed once and kept beside the model's weights.

Building an int8 runner calibrates it first (engine/int8_dynamic.py `activation_ranges`): four 512-token prefills of
the fp32 model, paid at every start of a `mid` engine, of a speculative draft, and by the restart that replaces a
crashed engine (its tier is out meanwhile). SmolLM2-135M's int8 runner took 12.4 s to build, 3.3 s with the ranges
kept (`python -m bench.int8_calibration`, two quiet Zen 3 cores; 47 s against 3.3 s on a loaded machine). The
ranges are a pure function of what goes in, so they are kept in the model directory, keyed on every input they
depend on, and a later build with the same inputs reads them back: the same tensors to the bit, so the same int8
model.

The key: the weights' content digest (engine/weight_digest.py), the calibration tokens, the sources of the engine
package, its C++ kernels' included (the forward that produces the activations), torch's version, its thread count
and the CPU path it takes (the bits of a matmul may depend on both), and the settings that pick engine paths. A key
that matches nothing computes and writes; the directory keeps the `KEEP` most recent entries. A directory we may
not write into, or an unreadable entry, only costs the calibration, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from assets.atomic_file import write_atomically
from engine.weight_digest import weights_digest

PREFIX = "tiergate-int8-ranges-"
KEEP = 8
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu")
ENGINE_SETTINGS = ("TIERGATE_NATIVE_KERNELS", "TIERGATE_ONEDNN", "TIERGATE_ONEDNN_AMX")
log = logging.getLogger("tiergate.engine")

Ranges = dict[str, torch.Tensor]


def cached_ranges(model_dir: Path, chunks: list[torch.Tensor], compute: Callable[[], Ranges]) -> Ranges:
    """The ranges for this model, these chunks and this process's engine: read back when kept, else `compute()`d
    and kept."""
    path = model_dir / f"{PREFIX}{ranges_key(model_dir, chunks)}.pt"
    with contextlib.suppress(OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
        kept = torch.load(path, weights_only=True)
        if isinstance(kept, dict) and all(isinstance(v, torch.Tensor) for v in kept.values()):
            os.utime(path)  # most recently used: kept longest
            return kept
    ranges = compute()
    _keep(path, ranges)
    return ranges


def ranges_key(model_dir: Path, chunks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(weights_digest(model_dir).encode())
    for ids in chunks:
        h.update(ids.to(torch.int64).numpy().tobytes() + b"|")
    h.update(_engine_source_digest().encode())
    settings = [f"{name}={os.environ.get(name)}" for name in ENGINE_SETTINGS]
    h.update(f"{torch.__version__}|{torch.get_num_threads()}|{torch.backends.cpu.get_cpu_capability()}|"
             f"{settings}".encode())
    return h.hexdigest()[:32]


@cache
def _engine_source_digest() -> str:
    """sha256 over the engine package's sources, its native kernels' C++ too (a change to the forward is a change to
    the ranges)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        h.update(f"{f.relative_to(root)}\n".encode() + f.read_bytes())
    return h.hexdigest()


def _keep(path: Path, ranges: Ranges) -> None:
    """Write the entry whole or not at all, then drop all but the KEEP most recent entries."""
    if (exc := write_atomically(path, lambda out: torch.save(ranges, out))) is not None:
        log.info("int8 ranges not kept (%s): the next start calibrates again", exc)
        return
    entries = sorted(path.parent.glob(f"{PREFIX}*.pt"), key=_mtime, reverse=True)
    for old in entries[KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
