"""Files a reader sees whole or not at all: written beside their place, then renamed over it.

Small files that processes of one machine share: the weights' digests (engine/weight_digest.py), the int8 tier's
calibrated ranges (engine/int8_ranges.py), the router's artifact (tiers/difficulty.py), the local engines a gateway
publishes to its workers (tiers/engines_file.py), the embedder's ONNX export (cache/onnx_runtime.py) and a
distillation's checkpoint (training/distill.py). Two processes may write the same one, and a reader must never find
half of it. Here, not in one of those packages, because each of them writes such files and none may import another
for it (tests/test_import_rules.py).

The temporary file is mkstemp's: a name no other writer takes, and owner-only, so a file that holds secrets (the
engines' nonces) is never readable by others, not even for a moment; one that others read is given its mode before
it appears.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def replacing(path: Path, *, mode: int = 0o600, sync: bool = False) -> Iterator[Path]:
    """A new, empty temporary file in `path`'s directory, for the block to write (by its path: an exporter that
    takes a file name can); when the block ends, it is given `mode`, flushed to disk where `sync` (a crash just after
    the rename then never leaves an empty file in `path`'s place), and renamed over `path`. Whatever raises, the
    block or any of that, the temporary file is removed and the error goes on."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if sync:
            _fsync(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> OSError | None:
    """Write `path` (owner-only) through `write(file)`, as `replacing` does; None once it is in place, else the
    OSError that stopped it. For a file whose loss costs only work: a directory we may not write into leaves things
    as they were. Any other error is raised; either way nothing is left behind."""
    try:
        with replacing(path) as tmp, open(tmp, "wb") as out:
            write(out)
    except OSError as exc:
        return exc
    return None


def leftovers(path: Path) -> list[Path]:
    """The temporary files of `path` that writers killed before their rename left behind."""
    return list(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
