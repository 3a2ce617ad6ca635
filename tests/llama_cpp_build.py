"""Builds llama.cpp's OpenAI-compatible server (the `llama-cpp-python[server]` package) once per machine, for the
tests that use it as a real remote tier (tests/llama_cpp_server.py runs it).

PyPI ships llama-cpp-python as source only, so pip compiles llama.cpp (cmake and a C++ compiler; scikit-build-core
fetches cmake from PyPI where the system has none recent enough). That happens once per machine, into a virtual
environment of its own under ~/.cache/tiergate, as the engine's C++ kernels are cached: a dev extra would compile
it on every fresh `make test` (which creates .venv anew), and the server's own dependencies (FastAPI, numpy) stay
out of the gateway's environment. The build is the smallest that serves a GGUF on a CPU: no GPU backend, no
multimodal library (LLAVA_BUILD=OFF), no `common` library and C++ at -O1 (tests/llama_cpp_build.cmake, read by
llama.cpp's project(): 208 s of wall and 358 s of CPU on an idle 2-core machine, where the full build took about 12
minutes), and GGML_NATIVE=OFF, so a cached build never holds an instruction that another CPU sharing the same home
directory lacks (ggml then still compiles its AVX2/FMA/F16C kernels; how fast a 135M model runs is not what these
tests look at: their time was the same with either build). A failed build fails the test with pip's last lines:
nothing is skipped. The build's marker records its inputs (the version, CMAKE_ARGS, the include file's text); any
checkout of the repository with the same inputs uses it, wherever it lies: the include's absolute path, which
CMAKE_ARGS holds, is not compared (it was, and every other worktree rebuilt llama.cpp), and a changed input rebuilds.

Standard library only, so CI can start the build (`python3 -m tests.llama_cpp_build`, in the background) while it
installs everything else; a test that needs the build meanwhile waits on its lock and then finds it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from assets.locks import file_lock

LLAMA_CPP_PYTHON = "0.3.36"
PROJECT_INCLUDE = Path(__file__).with_name("llama_cpp_build.cmake")  # no `common` library, C++ at -O1
INCLUDE_FLAG = "-DCMAKE_PROJECT_llama.cpp_INCLUDE"
BUILD_TIMEOUT_S = 3600.0  # the full build took about 25 minutes on a loaded 2-core machine; this one is smaller
MARKER = "tiergate-built.json"


def cmake_args(include: Path) -> str:
    """pip's CMAKE_ARGS: the include file by its absolute path (llama.cpp's project() reads it from pip's build
    directory)."""
    return f"-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF {INCLUDE_FLAG}={shlex.quote(str(include))}"


def build_inputs(include: Path) -> dict[str, str]:
    """What a build is made of, as its marker records it: the package's version, CMAKE_ARGS and the include's text."""
    return {"llama-cpp-python": LLAMA_CPP_PYTHON, "cmake_args": cmake_args(include), "include": include.read_text()}


def same_build(recorded: dict[str, str], wanted: dict[str, str]) -> bool:
    """Whether a marker's inputs make the build `wanted` would: all alike but where the include file lay (its text is
    compared), so a checkout elsewhere (another worktree, CI's) uses the build one made, not rebuilding it (~95 s)."""
    return _placeless(recorded) == _placeless(wanted)


def _placeless(inputs: dict[str, str]) -> dict[str, object]:
    args = [arg for arg in shlex.split(str(inputs.get("cmake_args", ""))) if not arg.startswith(f"{INCLUDE_FLAG}=")]
    return {**inputs, "cmake_args": args}


def venv_dir() -> Path:
    default = Path.home() / ".cache/tiergate" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-py{sys.version_info[0]}." \
                                                 f"{sys.version_info[1]}"
    return Path(os.environ.get("TIERGATE_LLAMA_CPP_VENV", default))


def ensure_built(include: Path = PROJECT_INCLUDE) -> Path:
    """The Python of a virtual environment with llama-cpp-python[server] built; builds it the first time, and again
    when an input changed (`same_build`)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    want = build_inputs(include)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(venv.parent / f".{venv.name}.lock"):
        marker = venv / MARKER
        if marker.is_file() and same_build(json.loads(marker.read_text()), want) and python.exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        log = venv.parent / f"{venv.name}.build.log"
        started = time.monotonic()
        print(f"\nbuilding llama-cpp-python {LLAMA_CPP_PYTHON} into {venv} (once per machine; log: {log})",
              file=sys.stderr, flush=True)
        env = os.environ | {"CMAKE_ARGS": want["cmake_args"], "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
        with open(log, "w") as out:
            for cmd in ([sys.executable, "-m", "venv", str(venv)],
                        [str(python), "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                         f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}"]):
                # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS, so a cached wheel could be another build's
                result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False,
                                        timeout=BUILD_TIMEOUT_S)
                if result.returncode != 0:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{' '.join(cmd[-3:])} failed ({result.returncode}); see {log}:\n{tail}")
        marker.write_text(json.dumps(want))
        print(f"built llama-cpp-python in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return python


if __name__ == "__main__":
    print(ensure_built())
