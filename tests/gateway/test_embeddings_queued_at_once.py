"""An embeddings request's texts go to the batcher in one call, each with a future, not each in a task of its own:
2,048 tasks made and run at once held the event loop about 7 ms a request (2.3 ms now). What a text's task did is
kept: `ready` says which texts have their vector (what a client that leaves is billed for), a failed pass fails the
request, and a request cancelled drops its texts still queued."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from cache.batcher import EmbeddingBatcher
from gateway.embeddings_service import EmbeddingsService


class Encoder:
    """A vector of each text's length; from the `hold_at`th pass on, each waits for `release`."""

    def __init__(self, hold_at: int = 10**9, fail: bool = False) -> None:
        self.passes: list[list[str]] = []
        self.hold_at = hold_at
        self.fail = fail
        self.release = threading.Event()

    def __call__(self, texts: list[str]) -> list[np.ndarray | None]:
        self.passes.append(list(texts))
        if len(self.passes) >= self.hold_at:
            self.release.wait(10)
        if self.fail:
            raise RuntimeError("the model broke")
        return [np.full(384, len(t), dtype=np.float32) for t in texts]


def service(encoder: Encoder) -> EmbeddingsService:
    """The service as far as `_vectors` reads it: its batcher (passes of 32)."""
    svc = EmbeddingsService.__new__(EmbeddingsService)
    svc.batcher = EmbeddingBatcher(encoder, max_batch=32, max_wait_s=0.0)
    return svc


def counting_tasks(loop: asyncio.AbstractEventLoop) -> list[Any]:
    made: list[Any] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)  # type: ignore[arg-type]
    return made


async def test_a_requests_texts_are_queued_at_once_without_a_task_each() -> None:
    svc = service(Encoder())
    texts = [f"text {i}" for i in range(2048)]
    ready = [False] * len(texts)
    loop = asyncio.get_running_loop()
    made = counting_tasks(loop)
    try:
        vectors = await svc._vectors(texts, "t1", ready)
    finally:
        loop.set_task_factory(None)
    assert vectors.shape == (2048, 384) and [int(v[0]) for v in vectors] == [len(t) for t in texts]
    assert all(ready) and made == []
    svc.batcher.close()


async def test_a_cancelled_request_marks_only_the_texts_embedded_and_drops_the_rest() -> None:
    encoder = Encoder(hold_at=2)
    svc = service(encoder)
    texts = [f"text {i}" for i in range(100)]
    ready = [False] * len(texts)
    task = asyncio.create_task(svc._vectors(texts, "t1", ready))
    while len(encoder.passes) < 2:
        await asyncio.sleep(0.005)
    task.cancel()
    encoder.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    first = set(encoder.passes[0])  # the second pass ran on, its caller gone: its vectors never came
    assert ready == [t in first for t in texts] and any(ready)
    assert len(encoder.passes) == 2 and sum(map(len, encoder.passes)) < len(texts)  # the rest never ran
    svc.batcher.close()


async def test_a_failed_pass_fails_the_request() -> None:
    svc = service(Encoder(fail=True))
    ready = [False] * 40
    with pytest.raises(RuntimeError, match="the model broke"):
        await svc._vectors([f"text {i}" for i in range(40)], "t1", ready)
    assert not any(ready)
    svc.batcher.close()
