"""The engine loop: one thread owns the model and steps every running sequence; asyncio callers stream.

Callers see three things: `generate` (an async iterator of outputs), `abort`, and `stats`. The loop is
schedule → run → postprocess; a faster runner and scheduler replace the inside, not this interface.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus


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


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    busy_s_total: float
    num_requests_finished: int


class LLMEngine:
    def __init__(self, runner: Any, tokenizer: Any, *, max_num_seqs: int = 8) -> None:
        from engine.sampler import Sampler  # torch stays out of import-time

        self.runner = runner
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len: int = runner.max_model_len
        self._sampler = Sampler()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._aborts: set[str] = set()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._busy_s_total = 0.0
        self._finished_total = 0
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ---- caller side (event loop thread) ----

    def start(self) -> None:
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
            self._waiting.append(seq)
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
            return EngineStats(len(self._running), len(self._waiting), self._prompt_tokens_total,
                               self._generation_tokens_total, self._busy_s_total, self._finished_total)

    # ---- engine side (loop thread) ----

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            seqs = self._schedule()
            if not seqs:
                self._wake.wait(timeout=0.5)
                continue
            for seq in seqs:
                t0 = time.perf_counter()
                logits = self.runner.prefill(seq) if seq.kv_state is None else self.runner.decode(seq)
                token_id = self._sampler.sample(seq.request_id, logits, seq.params)
                step_s = time.perf_counter() - t0
                seq.busy_s += step_s  # one sequence per forward: the whole step is its own
                self._busy_s_total += step_s
                self._postprocess(seq, token_id)

    def _schedule(self) -> list[Sequence]:
        """Apply aborts, admit waiting sequences by (priority, arrival), return those to step."""
        with self._lock:
            for seq in [s for s in self._waiting + self._running if s.request_id in self._aborts]:
                self._finish(seq, "abort")
            self._aborts.clear()
            self._waiting.sort(key=lambda s: (s.priority, s.arrival_time))
            while self._waiting and len(self._running) < self.max_num_seqs:
                seq = self._waiting.pop(0)
                seq.status = SequenceStatus.RUNNING
                self._running.append(seq)
            return list(self._running)

    def _postprocess(self, seq: Sequence, token_id: int) -> None:
        first = not seq.output_token_ids
        seq.output_token_ids.append(token_id)
        detok = self._detok[seq.request_id]
        reason: str | None = None
        text = ""
        if token_id in self.runner.eos_token_ids and not seq.params.ignore_eos:
            reason = "stop"
        else:
            text = detok.feed(token_id)
            if detok.stopped:
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= seq.params.max_tokens
                               or seq.num_prompt_tokens + seq.num_output_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None and not detok.stopped:
            text += detok.flush()
        with self._lock:
            self._generation_tokens_total += 1
            if first:
                self._prompt_tokens_total += seq.num_prompt_tokens
            if reason is not None:
                self._finish(seq, reason, text=text, new_ids=[token_id])
                return
        self._emit(seq, text, [token_id], finished=False)

    def _finish(self, seq: Sequence, reason: str, *, text: str = "", new_ids: list[int] | None = None) -> None:
        """Called with the lock held: free everything the sequence holds and send its last output."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self.runner.free(seq)
        self._sampler.release(seq.request_id)
        self._detok.pop(seq.request_id, None)
        self._finished_total += 1
        self._emit(seq, text, new_ids or [], finished=True)
        self._sinks.pop(seq.request_id, None)

    def _emit(self, seq: Sequence, text: str, new_ids: list[int], *, finished: bool) -> None:
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        loop, queue = sink
        out = RequestOutput(seq.request_id, text, new_ids, finished, seq.finish_reason,
                            seq.num_prompt_tokens, seq.num_output_tokens, seq.busy_s)
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, out)
