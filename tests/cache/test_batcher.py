"""The embedding batcher on its own, with a fake encoder: batches are bounded, equal texts are embedded once,
a lone text is not held back, and a failing forward pass fails only its own callers."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from cache.batcher import EmbeddingBatcher


class FakeEncoder:
    """One vector per text (its length), recording every batch; `gate` holds the worker until set."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def __call__(self, texts: list[str]) -> list[np.ndarray | None]:
        self.gate.wait(10)
        self.batches.append(list(texts))
        if self.fail:
            raise RuntimeError("the model broke")
        return [None if t == "skip" else np.full(3, len(t), dtype=np.float32) for t in texts]


async def test_texts_arriving_during_a_forward_pass_form_the_next_batches() -> None:
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=4, max_wait_s=0.0)
    encoder.gate.clear()
    first = asyncio.create_task(batcher.embed("a"))  # starts at once, and is held in the worker
    await asyncio.sleep(0.05)
    rest = [asyncio.create_task(batcher.embed("x" * i)) for i in range(1, 10)]
    await asyncio.sleep(0.05)
    encoder.gate.set()
    vectors = await asyncio.wait_for(asyncio.gather(first, *rest), timeout=10)
    assert [v[0] for v in vectors] == [1, *range(1, 10)]  # type: ignore[index]
    assert [len(b) for b in encoder.batches] == [1, 4, 4, 1]  # never more than max_batch in one forward
    batcher.close()


async def test_announced_lookups_are_waited_for_and_equal_texts_embedded_once() -> None:
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=8, max_wait_s=10.0)
    coming = [batcher.announce() for _ in range(3)]
    tasks = [asyncio.create_task(batcher.embed("same", c)) for c in coming[:2]]
    await asyncio.sleep(0.05)
    assert encoder.batches == []  # the third announced lookup has not arrived yet
    coming[2].close()  # ...and never will (an exact hit, say): the batch starts without it
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert encoder.batches == [["same"]] and all(r is not None and r[0] == 4 for r in results)
    assert await batcher.embed("skip") is None
    batcher.close()


async def test_a_failed_forward_pass_fails_its_callers_and_the_next_batch_runs() -> None:
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=8, max_wait_s=0.0)
    encoder.fail = True
    with pytest.raises(RuntimeError, match="the model broke"):
        await batcher.embed("a")
    encoder.fail = False
    assert (await batcher.embed("bb"))[0] == 2  # type: ignore[index]
    batcher.close()


async def test_a_caller_that_leaves_does_not_break_the_batch() -> None:
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=8, max_wait_s=0.0)
    encoder.gate.clear()
    busy = asyncio.create_task(batcher.embed("first"))
    await asyncio.sleep(0.05)
    leaving = asyncio.create_task(batcher.embed("leaves"))
    staying = asyncio.create_task(batcher.embed("stays"))
    await asyncio.sleep(0.01)
    leaving.cancel()
    encoder.gate.set()
    assert (await asyncio.wait_for(staying, timeout=5))[0] == 5  # type: ignore[index]
    await busy
    assert ["stays"] in encoder.batches and not any("leaves" in b for b in encoder.batches)
    batcher.close()


async def test_batches_take_turns_between_owners() -> None:
    """One owner's long queue holds another's text up for one batch, not for all of them."""
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=4, max_wait_s=0.0)
    encoder.gate.clear()
    first = asyncio.create_task(batcher.embed("held", owner="flood"))  # in the worker while the rest queue
    await asyncio.sleep(0.05)
    flood = [asyncio.create_task(batcher.embed(f"f{i}", owner="flood")) for i in range(20)]
    await asyncio.sleep(0.01)
    mine = [asyncio.create_task(batcher.embed(f"m{i}", owner="me")) for i in range(2)]
    await asyncio.sleep(0.05)
    encoder.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *flood, *mine), timeout=10)
    assert encoder.batches[1] == ["f0", "f1", "m0", "m1"]  # in queue order, two from each owner
    assert [t for b in encoder.batches for t in b if t.startswith("f")] == [f"f{i}" for i in range(20)]
    assert sum(len(b) for b in encoder.batches) == 23 and all(len(b) <= 4 for b in encoder.batches)
    batcher.close()


async def test_equal_texts_of_different_owners_are_embedded_apart() -> None:
    """A batch one text shorter would tell a tenant that another sent its very text at the same moment: equal
    texts are embedded once per owner, never shared across owners."""
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=8, max_wait_s=10.0)
    coming = [batcher.announce() for _ in range(3)]
    tasks = [asyncio.create_task(batcher.embed("same", c, owner=o)) for c, o in
             zip(coming, ["a", "b", "a"], strict=True)]
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert encoder.batches == [["same", "same"]]  # a's two once, b's apart
    assert all(r is not None and r[0] == 4 for r in results)
    batcher.close()


class CountedOwner:
    """An owner that counts how often it is hashed: each time the batcher files or finds one of its texts."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hashed = 0

    def __hash__(self) -> int:
        self.hashed += 1
        return hash(self.name)


async def test_a_batch_costs_its_own_texts_not_the_queue_behind_it() -> None:
    """The event loop's work for a queue of N texts is linear in N: a batch looks at the texts it takes (and those
    whose callers left), never at all the others queued. The queue was one list split into lanes again for every
    batch, N^2 / max_batch in all: 10 requests of 2,048 texts queued cost the loop 8.6 ms a batch, 5.5 s in all."""
    encoder = FakeEncoder()
    batcher = EmbeddingBatcher(encoder, max_batch=8, max_wait_s=0.0)
    owners = [CountedOwner("a"), CountedOwner("b")]
    encoder.gate.clear()
    first = asyncio.create_task(batcher.embed("held", owner=owners[0]))  # in the worker while the rest queue
    await asyncio.sleep(0.05)
    texts = 2048
    tasks = [asyncio.create_task(batcher.embed(f"t{i}", owner=owners[i % 2])) for i in range(texts)]
    leaving = [asyncio.create_task(batcher.embed(f"gone{i}", owner=owners[0])) for i in range(64)]
    await asyncio.sleep(0.05)
    for task in leaving:
        task.cancel()
    encoder.gate.set()
    vectors = await asyncio.wait_for(asyncio.gather(first, *tasks), timeout=30)
    assert [v[0] for v in vectors[1:]] == [len(f"t{i}") for i in range(texts)]  # type: ignore[index]
    assert sum(len(b) for b in encoder.batches) == texts + 1 and all(len(b) <= 8 for b in encoder.batches)
    assert not any(t.startswith("gone") for b in encoder.batches for t in b)
    # a few lookups per text (filed, taken, its vector found); the old queue: 256 batches x 2,112 texts
    assert sum(o.hashed for o in owners) < 10 * (texts + 64 + 1), [o.hashed for o in owners]
    batcher.close()
