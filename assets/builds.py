"""A model build as the server sees it: who holds it, how far it is, and how its budget is spelled.

One build per output directory at a time: an exclusive lock next to the output (`.<name>.lock`, holding the
builder's pid) that a second builder is refused at once, not queued behind. The builder writes its progress
to `.<name>.work/progress.json`, so the gateway can say "preparing: 40%" while it waits; the tier catalogue
checks a build's budget ("10m", "500steps") when it loads. Building itself (training/) needs torch; none of
this does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class BuildInProgress(Exception):
    """Another process is building this model now."""


class BudgetError(ValueError):
    """A build budget that is neither a time nor a step count."""


def work_dir_for(out: Path) -> Path:
    """Where the build of `out` keeps its checkpoint and progress."""
    return out.parent / f".{out.name}.work"


def lock_path_for(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold the one-builder lock of `out`, or raise BuildInProgress at once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path_for(out), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise BuildInProgress(f"{out} is being built by process {fh.read().strip() or '?'}") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_building(out: Path) -> bool:
    """Whether some process holds `out`'s build lock now."""
    path = lock_path_for(out)
    if not path.exists():
        return False
    with open(path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def build_progress(out: Path) -> dict[str, Any] | None:
    """The running build's last progress record, if one is running."""
    if not is_building(out):
        return None
    try:
        return json.loads((work_dir_for(out) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def write_progress(out: Path, record: dict[str, Any]) -> None:
    """Replace the build's progress record (atomically: a reader never sees half of one)."""
    work = work_dir_for(out)
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / "progress.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(work / "progress.json")


def parse_budget(text: str) -> tuple[float | None, int | None]:
    """'10m', '90s', '1.5h' → (seconds, None); '500steps' or '500 steps' → (None, 500)."""
    raw = text.strip().lower().replace(" ", "")
    units = {"steps": None, "step": None, "h": 3600.0, "m": 60.0, "min": 60.0, "s": 1.0}
    for suffix, scale in units.items():
        if raw.endswith(suffix):
            number = raw[: -len(suffix)]
            try:
                value = float(number)
            except ValueError:
                break
            if not math.isfinite(value) or value <= 0:  # nan, inf (and 1e999) are no budget
                break
            if scale is None:
                if value != int(value):
                    break
                return None, int(value)
            return value * scale, None
    raise BudgetError(f"budget {text!r}: use a time like 10m, 90s, 1h or a step count like 500steps")
