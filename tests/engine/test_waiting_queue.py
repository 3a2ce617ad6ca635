"""The engine's waiting queue: the order of admission is the policy's (checked against a reference on a random mix of
adds, preemptions, aborts and admissions), an aborted request is never scheduled, and past `max_waiting` requests
beyond the batch's slots a new one is refused with a 429 (`engine_overloaded`)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import deque
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from engine import launch
from engine.block_manager import BlockManager
from engine.llm_engine import ENGINE_OVERLOADED, EngineBusyError, LLMEngine
from engine.request_queue import FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.server import create_engine_app
from gateway.cli.main import cli
from tests.engine.fakes import CharTokenizer, ScriptedRunner
from tests.stubs import ServerThread


def seq(rid: str, *, priority: int = 0, t: float = 0.0, salt: str | None = None, n: int = 3) -> Sequence:
    return Sequence(rid, list(range(1, 1 + n)), SamplingParams(temperature=0, max_tokens=1), priority=priority,
                    arrival_time=t, cache_salt=salt)


class ReferencePriority:
    """The old queue's order, spelled out: a list sorted whole by (priority, arrival, order of adding)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, float, int, Sequence]] = []
        self.n = 0

    def add(self, s: Sequence) -> None:
        self.items.append((s.priority, s.arrival_time, self.n, s))
        self.n += 1

    prepend = add

    def order(self) -> list[Sequence]:
        return [item[3] for item in sorted(self.items, key=lambda item: item[:3])]

    def remove(self, s: Sequence) -> None:
        self.items = [item for item in self.items if item[3] is not s]


class ReferenceFCFS:
    def __init__(self) -> None:
        self.items: deque[Sequence] = deque()

    def add(self, s: Sequence) -> None:
        self.items.append(s)

    def prepend(self, s: Sequence) -> None:
        self.items.appendleft(s)

    def order(self) -> list[Sequence]:
        return list(self.items)

    def remove(self, s: Sequence) -> None:
        self.items = deque(x for x in self.items if x is not s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("rng_seed", range(5))
def test_queue_order_is_the_reference_on_a_random_mix(policy: str, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    queue: Any = FCFSRequestQueue() if policy == "fcfs" else PriorityRequestQueue()
    ref: Any = ReferenceFCFS() if policy == "fcfs" else ReferencePriority()
    out: list[Sequence] = []  # taken out (popped or removed): may come back as preempted
    for k in range(600):
        op = rng.random()
        if op < 0.4 or not ref.order():  # arrivals tie often: the order of adding breaks the tie
            s = seq(f"r{k}", priority=rng.choice((0, 0, 1, 5)), t=float(rng.randrange(40)))
            queue.add_request(s)
            ref.add(s)
        elif op < 0.55 and out:  # a preempted sequence goes back
            s = out.pop(rng.randrange(len(out)))
            queue.prepend_request(s)
            ref.prepend(s)
        elif op < 0.75:  # the head admitted
            assert queue.peek_request() is ref.order()[0]
            s = queue.pop_request()
            ref.remove(s)
            out.append(s)
        else:  # one anywhere: aborted, or admitted before the head
            s = rng.choice(ref.order())
            queue.remove_request(s)
            ref.remove(s)
            if rng.random() < 0.5:
                out.append(s)
        assert [x.request_id for x in queue] == [x.request_id for x in ref.order()]
        assert len(queue) == len(ref.order())


class Counted(float):
    """An arrival time that counts how often it is compared (its negation too)."""

    compared = 0

    def __lt__(self, other: object) -> bool:
        Counted.compared += 1
        return float(self) < float(other)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        Counted.compared += 1
        return float(self) == other

    __hash__ = float.__hash__

    def __neg__(self) -> Counted:
        return Counted(-float(self))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_abort_and_a_look_at_the_head_compare_few_keys(policy: str) -> None:
    """Not a timing: the work counted. With 4,096 waiting, aborting one and reading the first few in queue order
    compare a few dozen keys (a bisection), not every waiting one's (the old queue re-sorted the whole heap to
    iterate it, and rebuilt it for each removal: 2,000 aborts of 5,000 waiting took 1.7 s)."""
    queue: Any = FCFSRequestQueue() if policy == "fcfs" else PriorityRequestQueue()
    waiting = [seq(f"r{k}", t=Counted(k // 2)) for k in range(4096)]
    for s in waiting:
        queue.add_request(s)
    Counted.compared = 0
    queue.remove_request(waiting[1000])
    first = [s.request_id for _, s in zip(range(3), queue, strict=False)]
    assert first == ["r0", "r1", "r2"]
    assert Counted.compared <= 64, Counted.compared
    assert len(queue) == 4095 and waiting[1000] not in list(queue)


@pytest.mark.parametrize("policy", [SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY])
@pytest.mark.parametrize("rng_seed", range(3))
def test_admission_order_is_the_reference_and_aborted_never_run(policy: SchedulingPolicy, rng_seed: int) -> None:
    """One slot: each step admits the next waiting request, which then ends; some are aborted while they wait."""
    rng = random.Random(rng_seed)
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64,
                      eos_token_ids={0}, policy=policy)
    waiting = [seq(f"r{k}", priority=rng.choice((0, 1, 2)), t=float(rng.randrange(10))) for k in range(200)]
    for s in waiting:
        sched.add_request(s)
    aborted = set(rng.sample([s.request_id for s in waiting], 60))
    for s in waiting:
        if s.request_id in aborted:
            sched.finish(s, "abort")
    if policy is SchedulingPolicy.PRIORITY:
        expected = sorted((s for s in waiting if s.request_id not in aborted),
                          key=lambda s: (s.priority, s.arrival_time, int(s.request_id[1:])))
    else:
        expected = [s for s in waiting if s.request_id not in aborted]
    admitted: list[str] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert len(out.seqs) == 1
        admitted.append(out.seqs[0].request_id)
        sched.postprocess(out, [0] * sum(out.do_sample))  # EOS: it ends, the slot is free
    assert admitted == [s.request_id for s in expected]
    assert not aborted & set(admitted)


def test_aborted_waiting_requests_of_several_tenants_are_never_scheduled() -> None:
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                      eos_token_ids={0})
    waiting = [seq(f"r{k}", salt=f"t{k % 3}", t=float(k), priority=k % 2) for k in range(90)]
    for s in waiting:
        sched.add_request(s)
    aborted = {s.request_id for s in waiting[::3]}
    for s in waiting:
        if s.request_id in aborted:
            sched.finish(s, "abort")
    ran: set[str] = set()
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        ran.update(s.request_id for s in out.seqs)
        sched.postprocess(out, [0] * sum(out.do_sample))
    assert not sched.has_unfinished_requests()
    assert ran == {s.request_id for s in waiting} - aborted


async def hand_over(eng: LLMEngine, n: int) -> list[asyncio.Task[Any]]:
    """`n` requests handed to an engine whose loop never runs: they stay in flight."""
    async def one(k: int) -> None:
        async for _ in eng.generate([1, 2], SamplingParams(max_tokens=2), request_id=f"held-{k}"):
            pass

    tasks = [asyncio.ensure_future(one(k)) for k in range(n)]
    while len(eng.handoff.sinks) < n:
        await asyncio.sleep(0)
    return tasks


def test_the_cap_refuses_the_next_request_past_it() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer(), max_num_seqs=2, max_waiting=3)  # not started: nothing runs

    async def run() -> None:
        tasks = await hand_over(eng, 5)  # 2 slots + 3 waiting
        with pytest.raises(EngineBusyError) as refused:
            async for _ in eng.generate([1, 2], SamplingParams(max_tokens=2)):
                pass
        assert refused.value.code == ENGINE_OVERLOADED and refused.value.retry_after_s >= 1
        assert len(eng.handoff.sinks) == 5  # the refused one was never handed over
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    eng.compiles.close()


def test_the_default_cap_is_per_slot() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer(), max_num_seqs=3)
    assert eng.max_waiting == 48  # 16 a slot
    eng.compiles.close()


def test_the_server_answers_429_engine_overloaded() -> None:
    eng = LLMEngine(ScriptedRunner(), CharTokenizer(), max_num_seqs=1, max_waiting=1)  # not started: nothing runs
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()

    async def run() -> None:
        tasks = await hand_over(eng, 2)
        async with httpx.AsyncClient(timeout=10) as client:
            for stream in (False, True):
                r = await client.post(f"{server.url}/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert r.json()["error"]["code"] == ENGINE_OVERLOADED
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        server.stop()
        eng.compiles.close()


def test_a_cap_reached_after_the_servers_check_is_the_same_429() -> None:
    """Requests handed over while this one was tokenized: `generate` refuses it as it starts; a whole answer is the
    429, a stream (headers sent) ends with its error as the last event before [DONE]; not a 500 engine_error."""
    eng = LLMEngine(ScriptedRunner(), CharTokenizer(), max_num_seqs=1, max_waiting=0)  # not started: nothing runs
    real = eng.check_capacity
    calls = 0

    def filled_meanwhile() -> None:  # the server's check passes; generate's, next, finds the engine full
        nonlocal calls
        calls += 1
        if calls % 2 == 0:
            eng.handoff.sinks["someone-else"] = None  # type: ignore[assignment]
        try:
            real()
        finally:
            eng.handoff.sinks.pop("someone-else", None)

    eng.check_capacity = filled_meanwhile  # type: ignore[method-assign]
    server = ServerThread(create_engine_app(eng, model_name="tiny", model_version="v1")).start()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == ENGINE_OVERLOADED
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=10)
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == ENGINE_OVERLOADED
    finally:
        server.stop()
        eng.compiles.close()


class HeldRunner(ScriptedRunner):
    """A ScriptedRunner whose steps, once started (`entered`), wait for `go`: a long step (a prefill on CPU), held."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.go = threading.Event()

    def run(self, out: SchedulerOutput) -> list[int]:
        self.entered.set()
        self.go.wait()
        return super().run(out)


def test_an_aborted_request_frees_its_place_before_the_loops_next_step() -> None:
    """A client that cancels and retries while a long step runs is admitted: the aborted request stops counting at
    once, though the loop ends it (and frees its blocks) only at its next step. On a95f7b5 the retry was a 429."""
    runner = HeldRunner()
    eng = LLMEngine(runner, CharTokenizer(), max_num_seqs=2, max_waiting=1)  # 3 in flight at most
    eng.start()

    async def run() -> None:
        tasks = await hand_over(eng, 3)
        assert await asyncio.to_thread(runner.entered.wait, 60)  # a step runs, held (a bound against a hang only)
        with pytest.raises(EngineBusyError):
            eng.check_capacity()
        tasks[0].cancel()  # the client goes: leaving generate aborts its request
        await asyncio.gather(tasks[0], return_exceptions=True)
        assert "held-0" in eng.handoff.sinks  # not ended yet: the loop is still in its step

        async def retry() -> str:
            text = ""
            async for out in eng.generate([1, 2], SamplingParams(max_tokens=2), request_id="retry"):
                text += out.text
            return text

        retried = asyncio.ensure_future(retry())
        while "retry" not in eng.handoff.sinks and not retried.done():
            await asyncio.sleep(0)
        assert not retried.done(), retried.exception()  # admitted, not refused
        assert not runner.steps and not runner.go.is_set()  # before the held step ended, so before the next one
        with pytest.raises(EngineBusyError):  # the freed place is taken again
            eng.check_capacity()
        runner.go.set()
        assert await retried == "Pa"
        await asyncio.gather(*tasks[1:])
        assert "held-0" in runner.released and eng.num_in_flight == 0
        assert eng.block_manager.num_free_blocks == runner.num_kv_blocks  # the aborted one's blocks went back too

    try:
        asyncio.run(run())
    finally:
        runner.go.set()
        eng.shutdown()


def test_an_abort_frees_one_place_once() -> None:
    """Aborting one request twice (by id, then as its caller leaves) frees one place; an unknown id frees none; once
    the loop has ended it, its abort is forgotten (not subtracted again), and aborting it again does nothing."""
    eng = LLMEngine(ScriptedRunner(), CharTokenizer(), max_num_seqs=1, max_waiting=1)  # not started: the loop waits

    async def run() -> None:
        tasks = await hand_over(eng, 2)
        eng.abort("held-0")
        eng.abort("held-0")
        eng.abort("nobody")
        tasks[0].cancel()  # its caller leaves too: a third abort of the same request
        await asyncio.gather(tasks[0], return_exceptions=True)
        retried = asyncio.ensure_future(eng.generate([1, 2], SamplingParams(max_tokens=2),
                                                     request_id="retry").__anext__())
        while "retry" not in eng.handoff.sinks and not retried.done():
            await asyncio.sleep(0)
        assert not retried.done(), retried.exception()  # admitted, not refused
        assert eng.num_in_flight == 2
        with pytest.raises(EngineBusyError):  # one place was freed, not three
            eng.check_capacity()
        eng.step()  # the loop's next step: it applies the abort, and held-0's sink goes
        assert "held-0" not in eng.handoff.sinks and "held-0" in eng.model_runner.released
        assert eng.num_in_flight == 2  # held-1 and retry: the ended abort is not subtracted again
        eng.abort("held-0")  # an abort of a request already ended
        assert eng.num_in_flight == 2
        with pytest.raises(EngineBusyError):
            eng.check_capacity()
        for t in (*tasks[1:], retried):
            t.cancel()
        await asyncio.gather(*tasks[1:], retried, return_exceptions=True)

    asyncio.run(run())
    eng.compiles.close()


def test_engine_serve_takes_max_waiting_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tiergate engine serve --max-waiting N` sets the cap; left out, the engine's default (16 x max_num_seqs)."""
    served: dict[str, Any] = {}
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: served.update(kwargs))
    result = CliRunner().invoke(cli, ["engine", "serve", "--model", "x", "--max-waiting", "7"])
    assert result.exit_code == 0, result.output
    assert served["max_waiting"] == 7
    served.clear()
    assert CliRunner().invoke(cli, ["engine", "serve", "--model", "x"]).exit_code == 0
    assert served["max_waiting"] is None
    assert CliRunner().invoke(cli, ["engine", "serve", "--model", "x", "--max-waiting", "-1"]).exit_code == 2
