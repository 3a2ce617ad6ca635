"""Files a reader sees whole or not at all: written beside their place, then renamed over it.

The engine keeps small files of its own in a model's directory (the weights' digests, engine/weight_digest.py; the
int8 tier's calibrated ranges, engine/int8_ranges.py). Two engines starting together may write the same one, and a
reader must never find half of it; a directory we may not write into leaves things as they were, which only costs
the next start the work the file saves.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> OSError | None:
    """Write `path` through `write(file)` in a temporary file of its directory renamed over it; None once it is in
    place, else the OSError that stopped it (nothing is left behind)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        return exc
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return exc
    return None
