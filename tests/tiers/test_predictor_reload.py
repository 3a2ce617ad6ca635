"""A new artifact's load outlives the request that started it: a client leaving mid-load must not lose it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

from tests.tiers.test_predictor import Clock, FakeModel, load, write
from tiers.predictor import PredictorSource


class SlowLoader:
    """`load`, taking `seconds` in its worker thread; counts the loads started and finished."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = 0
        self.finished = 0
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def __call__(self, path: Path) -> FakeModel:
        with self._lock:
            self.started += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            time.sleep(self.seconds)
            return load(path)
        finally:
            with self._lock:
                self.running -= 1
                self.finished += 1


async def test_a_load_whose_caller_left_is_kept_and_not_repeated(tmp_path: Path) -> None:
    path = tmp_path / "difficulty.json"
    write(path, {"version": "v1"}, 1_000_000_000)
    clock = Clock()
    loader = SlowLoader(0.5)
    source = PredictorSource(path, loader, check_every_s=5, clock=clock)

    request = asyncio.create_task(source.current())
    await asyncio.sleep(0.1)  # the event loop runs while the model loads
    assert loader.started == 1 and loader.finished == 0
    request.cancel()  # its client left mid-load
    with contextlib.suppress(asyncio.CancelledError):
        await request

    model = await source.current()  # the file has not changed: the load under way (or done) is the answer
    assert model is not None and model.version == "v1"
    clock.t = 5  # looked at again: unchanged, so not loaded again
    assert (await source.current()) is model
    assert source.error is None
    assert loader.started == 1 and loader.finished == 1


async def test_the_load_finishes_and_is_kept_even_when_no_one_waits_for_it(tmp_path: Path) -> None:
    path = tmp_path / "difficulty.json"
    write(path, {"version": "v1"}, 1_000_000_000)
    loader = SlowLoader(0.5)
    source = PredictorSource(path, loader, check_every_s=5, clock=Clock())

    request = asyncio.create_task(source.current())
    await asyncio.sleep(0.1)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    for _ in range(100):  # no caller: the load completes on its own
        if loader.finished:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.05)
    assert source.model is not None and source.model.version == "v1"


async def test_callers_arriving_mid_load_share_the_one_load(tmp_path: Path) -> None:
    path = tmp_path / "difficulty.json"
    write(path, {"version": "v1"}, 1_000_000_000)
    clock = Clock()
    loader = SlowLoader(0.3)
    source = PredictorSource(path, loader, check_every_s=5, clock=clock)

    first = asyncio.create_task(source.current())
    await asyncio.sleep(0.05)
    first.cancel()
    models = await asyncio.gather(*(source.current() for _ in range(5)))
    assert all(m is not None and m.version == "v1" for m in models)
    assert loader.started == 1 and loader.most_at_once == 1

    write(path, {"version": "v2"}, 2_000_000_000)  # a retrained model: loaded once, by whoever looks first
    clock.t = 5
    models = await asyncio.gather(*(source.current() for _ in range(5)))
    assert all(m is not None and m.version == "v2" for m in models)
    assert loader.started == 2 and loader.most_at_once == 1
