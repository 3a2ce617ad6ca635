"""The content digest of a model directory's weight files, hashed once and recorded beside them.

The model version scopes the cache, so it must change whenever the weights do, even when a retrained model of the
same architecture (a re-run of `tiergate models distill`, a fine-tune copied in place) has files of the very same
names and sizes. Only the bytes tell them apart; names and sizes do not, and a sample of blocks can miss an edit
confined to a few tensors. But hashing gigabytes at every engine start costs seconds to minutes (about 0.8 GB/s on
one core: 0.7 s for SmolLM2-135M's 538 MB), so the sha256 of each weight file is recorded in RECORD, in the model
directory, with the file's size, mtime, ctime and inode, and a later start reuses it while all four are unchanged:
one stat per file. Any write to a file (an edit, another file renamed into place, a copy, even one that keeps its
source's mtime) changes its ctime at least, so the digest is recomputed then; so does a chmod, or another host's
copy of the directory, which costs only time. The engine keeps the record itself rather than `tiergate models
prepare` or distill: a directory copied in by hand gets one too, and is never trusted unverified.

The digest is of the contents only, so every host serving the same weights gets the same version (a fleet's
replicas share one cache scope); the record is a shortcut, never part of the version. A directory we may not write
into is hashed whole at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from assets.atomic_file import write_atomically

RECORD = "tiergate-weight-digests.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
CHUNK = 8 << 20
log = logging.getLogger("tiergate.engine")


def weight_files(model_dir: Path) -> list[Path]:
    return sorted({f for pattern in WEIGHT_PATTERNS for f in model_dir.glob(pattern) if f.is_file()})


def weights_digest(model_dir: Path) -> str:
    """sha256 over every weight file's name, size and content digest (recorded ones reused while valid)."""
    record = _read_record(model_dir)
    fresh: dict[str, Any] = {}
    h = hashlib.sha256()
    for f in weight_files(model_dir):
        stat = _stat(f)
        known = record.get(f.name)
        if isinstance(known, dict) and isinstance(known.get("sha256"), str) \
                and {k: known.get(k) for k in stat} == stat:
            digest = known["sha256"]
        else:
            digest = _file_sha256(f)
            if _stat(f) != stat:
                raise RuntimeError(f"{f} changed while it was being hashed; start the engine again once it is written")
        fresh[f.name] = stat | {"sha256": digest}
        h.update(f"{f.name}:{stat['size']}:{digest}\n".encode())
    if fresh != record:
        _write_record(model_dir, fresh)
    return h.hexdigest()


def _stat(path: Path) -> dict[str, int]:
    """What any write to the file, or another file renamed or copied over it, changes: the ctime and inode as well
    as the size and mtime (a copy that keeps its source's mtime, `cp -p`, still gets a new ctime)."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def _file_sha256(path: Path) -> str:
    log.info("hashing %s (once: the digest is recorded in %s)", path, RECORD)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _read_record(model_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((model_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(model_dir: Path, record: dict[str, Any]) -> None:
    """Atomically (two engines starting together each write a whole record); a read-only directory is left be."""
    text = json.dumps(record, indent=1, sort_keys=True).encode()
    if (exc := write_atomically(model_dir / RECORD, lambda out: out.write(text))) is not None:
        log.warning("cannot record the weights' digests in %s (%s): they are hashed again at every start",
                    model_dir, exc)
