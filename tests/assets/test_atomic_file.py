"""Files written whole or not at all: a reader finds the old file or the new one, a failed write leaves neither a
half file nor a temporary one, and the file gets its mode (owner-only unless asked) before it appears."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from assets import atomic_file
from assets.atomic_file import leftovers, replacing, write_atomically


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_write_is_in_place_whole_and_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    path.write_bytes(b"old")
    assert write_atomically(path, lambda out: out.write(b"new")) is None
    assert path.read_bytes() == b"new" and mode_of(path) == 0o600 and not leftovers(path)


@pytest.mark.parametrize("error", [ValueError("not picklable"), OSError(28, "No space left on device")])
def test_a_write_that_fails_leaves_the_old_file_and_nothing_else(tmp_path: Path, error: Exception) -> None:
    """Whatever stops the writer (a torch.save that cannot pickle, a full disk), the temporary file goes too: a
    ValueError left it behind, in a model's directory, at every start."""
    path = tmp_path / "ranges.pt"
    path.write_bytes(b"old")

    def half(out: object) -> None:
        out.write(b"ha")  # type: ignore[attr-defined]
        raise error

    if isinstance(error, OSError):
        assert write_atomically(path, half) is error
    else:
        with pytest.raises(ValueError):
            write_atomically(path, half)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["ranges.pt"]


def test_a_directory_that_cannot_be_written_is_reported_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "record.json"
    assert isinstance(write_atomically(path, lambda out: out.write(b"x")), FileNotFoundError)
    assert not path.parent.exists()


def test_the_mode_is_set_before_the_file_appears_and_it_is_private_while_written(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    with replacing(path, mode=0o644) as tmp:
        assert tmp.parent == tmp_path and tmp.exists() and mode_of(tmp) == 0o600 and not path.exists()
        tmp.write_bytes(b"graph")  # written by its path, as an exporter writes it
        assert leftovers(path) == [tmp]
    assert path.read_bytes() == b"graph" and mode_of(path) == 0o644 and not leftovers(path)


def test_sync_flushes_the_file_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "difficulty.json"
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(path.exists())  # False: not yet in place
        real_fsync(fd)

    monkeypatch.setattr(atomic_file.os, "fsync", fsync)
    with replacing(path) as tmp:
        tmp.write_text("{}")
    assert synced == []
    path.unlink()
    with replacing(path, sync=True) as tmp:
        tmp.write_text("{}")
    assert synced == [False] and path.read_text() == "{}"
