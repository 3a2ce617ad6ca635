"""Freeing a thread's idle OpenMP workers: the worker threads go, and torch still computes afterwards.
(What it is for, a faster engine loop thread, is measured by bench/engine_profile.py, not timed here.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from engine.openmp import release_thread_pool

LIBGOMP_LOADED = "libgomp" in Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else False


def num_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def settled_threads(expected: int) -> int:
    """The thread count once it reaches `expected` (freed workers exit on their own time), or after 5 s."""
    deadline = time.monotonic() + 5
    while num_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return num_threads()


@pytest.mark.skipif(not LIBGOMP_LOADED, reason="torch does not use GNU OpenMP here")
def test_release_then_parallel_work_on_this_and_another_thread() -> None:
    a, b = torch.randn(300, 400), torch.randn(400, 500)
    want = (a.double() @ b.double()).float()
    torch.set_num_threads(2)
    torch.testing.assert_close(a @ b, want, rtol=1e-4, atol=1e-3)  # a pool with a worker thread exists now
    with_pool = num_threads()
    assert release_thread_pool() is True
    assert settled_threads(with_pool - 1) == with_pool - 1  # the worker is gone
    torch.testing.assert_close(a @ b, want, rtol=1e-4, atol=1e-3)  # and comes back on demand
    assert num_threads() == with_pool
    assert release_thread_pool() is True
    got: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: got.append(a @ b))
    worker.start()
    worker.join()
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-3)


def test_without_libgomp_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import openmp

    monkeypatch.setattr(openmp, "_libgomps", lambda: ())
    assert release_thread_pool() is False
