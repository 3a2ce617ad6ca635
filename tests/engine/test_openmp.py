"""Freeing a thread's idle OpenMP workers: found in torch's libgomp, and torch still computes afterwards.
(What it is for, a faster engine loop thread, is measured by bench/engine.py, not timed here.)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.openmp import release_thread_pool

LIBGOMP_LOADED = "libgomp" in Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else False


@pytest.mark.skipif(not LIBGOMP_LOADED, reason="torch does not use GNU OpenMP here")
def test_release_then_parallel_work_on_this_and_another_thread() -> None:
    a, b = torch.randn(300, 400), torch.randn(400, 500)
    want = (a.double() @ b.double()).float()
    torch.testing.assert_close(a @ b, want, rtol=1e-4, atol=1e-3)  # a pool exists now
    assert release_thread_pool() is True
    torch.testing.assert_close(a @ b, want, rtol=1e-4, atol=1e-3)  # and comes back on demand
    assert release_thread_pool() is True
    got: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: got.append(a @ b))
    worker.start()
    worker.join()
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-3)


def test_without_libgomp_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import openmp

    monkeypatch.setattr(openmp, "_libgomp", lambda: None)
    assert release_thread_pool() is False
