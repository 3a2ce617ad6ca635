"""The llama.cpp build's marker (tests/llama_cpp_build.py), without building llama.cpp: pip's build is replaced by
one that only makes the virtual environment's `python`. A build made from one checkout is found by another with the
same inputs (the marker held the include file's absolute path, and every other worktree rebuilt, ~95 s); a changed
input is built again."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests import llama_cpp_build
from tests.llama_cpp_build import MARKER, PROJECT_INCLUDE, ensure_built

TEXT = PROJECT_INCLUDE.read_text()


def checkout(root: Path, text: str = TEXT) -> Path:
    """The include file of a checkout at `root`."""
    include = root / "tests" / "llama_cpp_build.cmake"
    include.parent.mkdir(parents=True)
    include.write_text(text)
    return include


@pytest.fixture
def builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The CMAKE_ARGS of each build made (the venv in tmp_path, pip's install not run)."""
    made: list[str] = []
    venv = tmp_path / "venv"

    def run(cmd: list[str], *, env: dict[str, str], **_: object) -> subprocess.CompletedProcess[bytes]:
        if cmd[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").touch()
            made.append(env["CMAKE_ARGS"])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setenv("TIERGATE_LLAMA_CPP_VENV", str(venv))
    monkeypatch.setattr(llama_cpp_build.subprocess, "run", run)
    return made


def test_a_build_is_found_from_another_checkout(tmp_path: Path, builds: list[str]) -> None:
    python = ensure_built(checkout(tmp_path / "a"))
    assert python.exists() and len(builds) == 1 and str(tmp_path / "a") in builds[0]  # pip reads the include there
    assert ensure_built(checkout(tmp_path / "b")) == python and len(builds) == 1


def test_a_build_recorded_with_another_include_path_is_found(tmp_path: Path, builds: list[str]) -> None:
    """A marker written by the code before this one (its CMAKE_ARGS name the include of the checkout that built it)."""
    ensure_built(checkout(tmp_path / "a"))
    marker = tmp_path / "venv" / MARKER
    recorded = json.loads(marker.read_text())
    recorded["cmake_args"] = recorded["cmake_args"].replace(str(tmp_path / "a"), "/work/main")
    marker.write_text(json.dumps(recorded))
    ensure_built(checkout(tmp_path / "b"))
    assert len(builds) == 1


def test_a_changed_include_is_built_again(tmp_path: Path, builds: list[str]) -> None:
    ensure_built(checkout(tmp_path / "a"))
    changed = checkout(tmp_path / "b", TEXT + "set(LLAMA_BUILD_TOOLS OFF)\n")
    ensure_built(changed)
    assert len(builds) == 2 and str(changed) in builds[1]
    assert json.loads((tmp_path / "venv" / MARKER).read_text())["include"] == changed.read_text()
    ensure_built(changed)
    assert len(builds) == 2


@pytest.mark.parametrize("field", ["llama-cpp-python", "cmake_args"])
def test_another_version_or_flag_is_built_again(tmp_path: Path, builds: list[str], field: str) -> None:
    include = checkout(tmp_path / "a")
    ensure_built(include)
    marker = tmp_path / "venv" / MARKER
    recorded = json.loads(marker.read_text())
    recorded[field] = recorded[field].replace("0.", "9.") if field == "llama-cpp-python" else \
        recorded[field].replace("-DGGML_NATIVE=OFF", "-DGGML_NATIVE=ON")
    assert recorded != json.loads(marker.read_text())
    marker.write_text(json.dumps(recorded))
    ensure_built(include)
    assert len(builds) == 2
