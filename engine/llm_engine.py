"""The engine loop: one thread owns the model and steps the batch; asyncio callers stream.

Callers see `generate` (an async iterator of outputs), `abort`, `validate` and `stats`. Each step is
schedule → run → postprocess: the scheduler picks sequences and token counts, the model runner computes
them all in one batched forward and samples, the scheduler advances them; the engine then detokenizes,
applies stop strings and streams. Requests and aborts cross from the event loop through a locked inbox
that the loop drains at the start of each step, so an abort takes effect within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.openmp import release_thread_pool
from engine.request_queue import SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence

THROUGHPUT_WINDOW_S = 10.0  # tokens/s in stats is measured over this trailing window


class EngineInputError(ValueError):
    """The request can never be served by this engine (too long, empty); maps to HTTP 400."""


@dataclass
class RequestOutput:
    request_id: str
    text: str  # text made since the previous output
    token_ids: list[int]  # tokens made since the previous output
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    busy_s: float  # engine compute time attributed to the request so far
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # per token in `token_ids`, when the request asked: (log-probability, [(token id, log-probability)] top others)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    busy_s_total: float
    num_requests_finished: int
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0  # held by a running sequence
    num_kv_blocks_free: int = 0  # idle (some still hold a reusable prefix)
    num_prefix_query_tokens_total: int = 0
    num_prefix_hit_tokens_total: int = 0
    num_preemptions_total: int = 0
    generation_tokens_per_s: float = 0.0  # over the last THROUGHPUT_WINDOW_S seconds

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.num_prefix_query_tokens_total
        return self.num_prefix_hit_tokens_total / q if q else 0.0


class LLMEngine:
    def __init__(self, runner: Any, tokenizer: Any, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 512,
                 policy: SchedulingPolicy = SchedulingPolicy.PRIORITY, enable_prefix_caching: bool = True) -> None:
        self.model_runner = runner
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len: int = runner.max_model_len
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   eos_token_ids=set(runner.eos_token_ids), policy=policy)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._seqs: dict[str, Sequence] = {}  # every unfinished request, by id
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._busy_s_total = 0.0
        self._finished_total = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens made) per step, for tokens/s
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ---- caller side (event loop thread) ----

    def start(self) -> None:
        # the thread that built the model frees its OpenMP workers, so the loop thread's own keep busy-waiting
        # between parallel regions (engine/openmp.py: 8-9% of a decode step on 2 cores)
        release_thread_pool()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise EngineInputError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise EngineInputError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"needs {len(prompt_token_ids)} prompt tokens + {params.max_tokens} output tokens = {total}"
            )
        bm = self.block_manager
        if bm.num_blocks_for(total) > bm.num_blocks:
            raise EngineInputError(
                f"this engine's KV cache holds {bm.num_blocks * bm.block_size} tokens; the request "
                f"needs {len(prompt_token_ids)} prompt tokens + {params.max_tokens} output tokens = {total}"
            )

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request; leaving the iterator early aborts the request."""
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._counter)}"
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority)
        with self._lock:
            if request_id in self._sinks:
                raise EngineInputError(f"request id {request_id!r} is already running")
            self._sinks[request_id] = (asyncio.get_running_loop(), queue)
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
            self._inbox.append(seq)
        self._wake.set()
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._sinks:
                self._aborts.add(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            now = time.monotonic()
            window = [n for t, n in self._recent if now - t <= THROUGHPUT_WINDOW_S]
            bm = self.block_manager
            num_used = bm.num_used_blocks
            return EngineStats(
                len(self.scheduler.running), len(self.scheduler.waiting) + len(self._inbox),
                self._prompt_tokens_total, self._generation_tokens_total, self._busy_s_total, self._finished_total,
                num_kv_blocks_total=bm.num_blocks, num_kv_blocks_used=num_used,
                num_kv_blocks_free=bm.num_blocks - num_used,
                num_prefix_query_tokens_total=bm.num_prefix_query_tokens,
                num_prefix_hit_tokens_total=bm.num_prefix_hit_tokens,
                num_preemptions_total=self.scheduler.num_preemptions_total,
                generation_tokens_per_s=sum(window) / THROUGHPUT_WINDOW_S,
            )

    # ---- engine side (loop thread) ----

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if not self.step():
                self._wake.wait(timeout=0.5)

    def step(self) -> bool:
        """One engine step; False when there was nothing to run."""
        with self._lock:
            self._drain_inbox()
            out = self.scheduler.schedule()
        if out.is_empty:
            return False
        t0 = time.perf_counter()
        token_ids = self.model_runner.run(out)
        step_s = time.perf_counter() - t0
        with self._lock:
            made = self.scheduler.postprocess(out, token_ids)
            self._account(out, step_s, len(made))
            for seq, token_id in made:
                self._stream(seq, token_id)
        return True

    def _drain_inbox(self) -> None:
        """Called with the lock held: admit new requests to the scheduler, apply aborts."""
        for seq in self._inbox:
            self._seqs[seq.request_id] = seq
            self.scheduler.add_request(seq)
        self._inbox.clear()
        for request_id in self._aborts:
            seq = self._seqs.get(request_id)
            if seq is not None:
                self.scheduler.finish(seq, "abort")
                self._release(seq)
                self._emit(seq, "", [], finished=True)
        self._aborts.clear()

    def _account(self, out: SchedulerOutput, step_s: float, num_made: int) -> None:
        """Share the step's compute time among its sequences by their tokens (the ledger's compute cost)."""
        total = out.total_num_scheduled_tokens
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            seq.busy_s += step_s * n / total
        self._busy_s_total += step_s
        self._generation_tokens_total += num_made
        now = time.monotonic()
        self._recent.append((now, num_made))
        while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def _stream(self, seq: Sequence, token_id: int) -> None:
        """Called with the lock held: detokenize one new token, apply stop strings, send the output."""
        if seq.num_output_tokens == 1:
            self._prompt_tokens_total += seq.num_prompt_tokens
        lp = self.model_runner.last_logprobs.get(seq.request_id)  # before release forgets it
        detok = self._detok[seq.request_id]
        text = ""
        if seq.finish_reason != "stop" or token_id not in self.scheduler.eos_token_ids:
            text = detok.feed(token_id)
            if detok.stopped:
                self.scheduler.finish(seq, "stop")
        if seq.is_finished:
            if not detok.stopped:
                text += detok.flush()
            self._release(seq)
        self._emit(seq, text, [token_id], finished=seq.is_finished, logprobs=[lp] if lp is not None else None)

    def _release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self.model_runner.release(seq.request_id)
        self._finished_total += 1

    def _emit(self, seq: Sequence, text: str, new_ids: list[int], *, finished: bool,
              logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None) -> None:
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        if finished:
            self._sinks.pop(seq.request_id, None)
        loop, queue = sink
        out = RequestOutput(seq.request_id, text, new_ids, finished, seq.finish_reason, seq.num_prompt_tokens,
                            seq.num_output_tokens, seq.busy_s, seq.num_cached_tokens, logprobs)
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, out)
