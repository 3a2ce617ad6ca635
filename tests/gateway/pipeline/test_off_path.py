"""Off-path calls: at most so many in flight, and at most so many of one owner's."""

from __future__ import annotations

import asyncio

from gateway.pipeline.off_path import OffPathTasks


def test_one_owner_cannot_take_every_place() -> None:
    async def main() -> list[bool]:
        tasks, release = OffPathTasks(4, max_per_owner=2), asyncio.Event()

        async def work() -> None:
            await release.wait()

        started = [tasks.start(work(), owner="a") for _ in range(3)]  # the third is one too many of a's
        started += [tasks.start(work(), owner="b"), tasks.start(work()), tasks.start(work(), owner="c")]
        release.set()
        await tasks.drain()
        started.append(tasks.start(work(), owner="a"))  # a's places are free again once its calls ended
        await tasks.drain()
        return started

    assert asyncio.run(main()) == [True, True, False, True, True, False, True]  # c: the 4 places are taken
