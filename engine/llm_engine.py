"""The engine loop: one thread owns the model and steps the batch; asyncio callers stream.

Callers see `generate` (an async iterator of outputs), `abort`, `validate`, `compiled_grammar`, `stats` and
`dead_reason`. Each
step is schedule → run → postprocess: the scheduler picks sequences and token counts, the model runner
computes them all in one batched forward and samples, the scheduler advances them; the engine then
detokenizes, applies stop strings and streams. Requests and aborts cross from the event loop through a
locked inbox that the loop drains at the start of each step, so an abort takes effect within one step
(engine/handoff.py).

Failures stay as small as they can be. A sequence whose sampling, log-probabilities or detokenization
raise fails alone; a forward pass that raises fails the sequences of its step; either way each failed
request gets a last output carrying `error` and its KV blocks go back, and the loop goes on. An exception
anywhere else (the scheduler, the bookkeeping) ends the loop: every request in flight then gets an
`engine_dead` error at once, `generate` refuses new ones with EngineDeadError, and `dead_reason` says why. A loop
that is alive but wedged (one step, or one grammar compile, running far past any honest one: engine/liveness.py) is
named by `health_problem`, which /health answers with, so the supervisor restarts it.

Locking: the handoff's lock (engine/handoff.py) guards only what callers and the loop share (the inbox, the aborts,
the output sinks of engine/output_sink.py) and is held for a few dictionary operations, never across a step.
Everything else is the loop thread's own. `stats()` takes no lock: the loop's counters (engine/engine_counters.py)
are read as they are, so /health never waits on a step however slow it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from engine.block_manager import BlockManager
from engine.compile_queue import CompileQueue, EngineBusyError
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_counters import EngineCounters
from engine.grammar import CompiledGrammar, GrammarCache, grammar_key
from engine.handoff import EngineDeadError, Handoff
from engine.liveness import STUCK_COMPILE_S, STUCK_STEP_S, Liveness
from engine.openmp import release_thread_pool
from engine.output_sink import OutputSink
from engine.outputs import EngineStats, RequestOutput
from engine.request_checks import check_request
from engine.request_queue import SchedulingPolicy
from engine.sampling_params import EngineInputError, SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, salt_tenant
from engine.speculative import SpeculativeDecoder
from wire.errors import RESPONSE_FORMAT_FAILED

__all__ = ["EngineBusyError", "EngineDeadError", "EngineInputError", "EngineStats", "LLMEngine", "RequestOutput"]

IDLE_WAIT_S = 0.5  # an idle loop wakes this often (and on every new request)
# Requests that may wait beyond the batch's slots, by default: this many per slot (max_num_seqs). The gateway never
# sends more than max_num_seqs a replica (its dispatch slots), but the engine's own port takes any caller with its
# key (or any local process), and each waiting request costs every step a look (the scheduler's tenant shares read
# all the waiting of the head's priority): 20,000 waiting cost 0.1-0.6 s a step before the cap
WAITING_PER_SLOT = 16
ENGINE_OVERLOADED = "engine_overloaded"  # the 429's code past the cap
OVERLOADED_RETRY_AFTER_S = 1
log = logging.getLogger("tiergate.engine")


class LLMEngine:
    def __init__(self, runner: Any, tokenizer: Any, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 512,
                 policy: SchedulingPolicy = SchedulingPolicy.PRIORITY, enable_prefix_caching: bool = True,
                 speculative: SpeculativeDecoder | None = None, stuck_after_s: float = STUCK_STEP_S,
                 compile_stuck_after_s: float = STUCK_COMPILE_S, max_waiting: int | None = None) -> None:
        """`speculative`: a draft model's decoder (engine/speculative.py) for the decode steps it applies to.
        `stuck_after_s`, `compile_stuck_after_s`: how long one step may run, and how much CPU one grammar compile may
        use, before `health_problem` calls the engine wedged (engine/liveness.py). `max_waiting`: how many requests
        may be in flight beyond the batch's `max_num_seqs` (None: WAITING_PER_SLOT per slot); past that a new one is
        refused (`check_capacity`)."""
        if max_waiting is not None and max_waiting < 0:
            raise ValueError("max_waiting must be 0 or more")
        self.model_runner = runner
        self.speculative = speculative
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_waiting = WAITING_PER_SLOT * max_num_seqs if max_waiting is None else max_waiting
        self.max_model_len: int = runner.max_model_len
        # prompt ids must index the model's embeddings (a runner without a config is a test double)
        self.vocab_size: int | None = getattr(getattr(runner, "config", None), "vocab_size", None)
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   eos_token_ids=set(runner.eos_token_ids), policy=policy)
        # response formats compiled for this tokenizer, once each (thread-safe), on threads of their own shared fairly
        # between tenants (engine/compile_queue.py)
        self.grammars = GrammarCache(tokenizer, vocab_size=self.vocab_size, eos_token_ids=list(runner.eos_token_ids))
        self.compiles = CompileQueue()
        self.liveness = Liveness(self.compiles, stuck_after_s=stuck_after_s,
                                 compile_stuck_after_s=compile_stuck_after_s)
        self._compiling: dict[tuple[str | None, str], Future[CompiledGrammar]] = {}  # (tenant, grammar key) ->
        # its compile, queued or running
        self.handoff = Handoff()  # shared with callers, under its lock: new requests, aborts, output sinks
        # requests a caller aborted that the loop has not ended yet, by id (each the very request aborted): their
        # places under the cap are free at once (`num_in_flight`), their blocks when the loop applies the abort.
        # Only callers touch it, under its own lock (the loop never takes it); `num_in_flight` forgets the ended ones
        self._aborting: dict[str, Sequence] = {}
        self._aborting_lock = threading.Lock()
        # the loop thread's own
        self._wake = threading.Event()
        self._stopping = False
        self._seqs: dict[str, Sequence] = {}  # every unfinished request the scheduler knows, by id
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        self._counters = EngineCounters()  # read by stats() without the lock
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ---- caller side (event loop thread) ----

    def start(self) -> None:
        # the thread that built the model frees its OpenMP workers, so the loop thread's own keep busy-waiting
        # between parallel regions (engine/openmp.py: 8-9% of a decode step on 2 cores)
        release_thread_pool()
        self._thread.start()
        threading.Thread(target=self.grammars.warm, name="grammar-warm", daemon=True).start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.compiles.close()

    @property
    def dead_reason(self) -> str | None:
        """Why the loop has stopped, or None while it runs (or has not been started)."""
        if self.handoff.dead_reason is None and self._thread.ident is not None and not self._thread.is_alive():
            return "the engine loop thread has stopped"
        return self.handoff.dead_reason

    @property
    def health_problem(self) -> str | None:
        """Why this engine cannot serve now, or None; what /health answers (the supervisor restarts an engine that
        is not ok). Its loop has stopped (`dead_reason`), or it runs but is wedged (`Liveness.problem`: a step past
        its bound, or a grammar compile past its CPU bound). Read without the lock, as `stats`: never waits on a
        step."""
        if (reason := self.dead_reason) is not None:
            return reason
        return self.liveness.problem()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, tenant: str | None) -> None:
        """Raise EngineInputError (naming the field) for a request this engine can never serve
        (engine/request_checks.py)."""
        check_request(prompt_token_ids, params, tenant, vocab_size=self.vocab_size,
                      max_model_len=self.max_model_len, block_manager=self.block_manager, grammars=self.grammars)

    @property
    def num_in_flight(self) -> int:
        """Requests that count toward the cap: handed over and not ended (running, waiting, or not taken by the loop
        yet), less those aborted: a caller that cancels and retries while a long step runs gets its place back at
        once, though the aborted one's blocks go back only when the loop applies the abort at its next step.

        Never below the truth, never negative: the handoff's sinks are read without its lock (as stats(): the loop
        only takes sinks away meanwhile), and an aborted request is subtracted only while its sink is still there
        (once, however often it was aborted); one whose sink has gone (ended since) is forgotten for good."""
        with self._aborting_lock:
            in_flight = len(self.handoff.sinks)
            for request_id, seq in list(self._aborting.items()):
                sink = self.handoff.sinks.get(request_id)
                if sink is not None and sink.seq is seq:
                    in_flight -= 1
                else:
                    del self._aborting[request_id]
        return in_flight

    def check_capacity(self) -> None:
        """EngineBusyError (HTTP 429 `engine_overloaded`, Retry-After) when `max_num_seqs` + `max_waiting` requests are
        in flight already (`num_in_flight`: an aborted one no longer counts). `generate` checks it as it hands a
        request over; the server before it renders and tokenizes one."""
        in_flight = self.num_in_flight
        if in_flight >= self.max_num_seqs + self.max_waiting:
            raise EngineBusyError(
                f"this engine has {in_flight} requests in flight, as many as it takes ({self.max_num_seqs} running "
                f"and {self.max_waiting} waiting); try again later", code=ENGINE_OVERLOADED,
                retry_after_s=OVERLOADED_RETRY_AFTER_S)

    async def compiled_grammar(self, params: SamplingParams, tenant: str | None) -> CompiledGrammar | None:
        """The compiled grammar of the request's response format (None without one): a format `tenant` compiled
        before at once (grammars are cached per tenant: engine/grammar.py), a new one compiled on the compile queue's
        threads, `tenant`'s turn among the tenants waiting (the caller waits without holding a thread).
        EngineInputError for a schema that cannot be compiled, EngineBusyError when the queue has no room for it,
        EngineDeadError once the loop has stopped."""
        if (fmt := params.output_format) is None:
            return None
        if (hit := self.grammars.known(fmt, tenant)) is not None:
            return hit
        if (reason := self.dead_reason) is not None:  # nothing will run it: no compile either
            raise EngineDeadError(f"the engine has stopped: {reason}")
        key = (tenant, grammar_key(fmt))
        if (running := self._compiling.get(key)) is None:  # one compile a tenant's schema: the same new one asked for
            # at once (a client's burst) waits for it and takes no place of its own in the queue; per tenant, so that
            # another tenant asking for a schema queued behind a flood is not put at the flood's place in line (its
            # own job compiles it: each tenant's grammars are its own)
            running = self.compiles.submit(tenant, lambda: self.grammars.compile(fmt, tenant))
            self._compiling[key] = running
            running.add_done_callback(lambda done: self._compiling.pop(key, None) if self._compiling.get(key) is done
                                      else None)
        # a caller that leaves does not cancel the compile the others wait for; the last to leave takes it out of the
        # queue if it has not started (a running one finishes: its result is kept)
        return await self.compiles.join(running)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request; leaving the iterator early aborts the request.

        Raises EngineInputError for a request that can never run, EngineDeadError once the loop has stopped,
        EngineBusyError when its response format is new and the compile queue is full, or when the engine has as many
        requests in flight as it takes (`check_capacity`). A request the engine fails
        later ends with an output whose `error` is set. A response format not compiled yet is compiled on the
        compile queue (`compiled_grammar`, the tenant being `cache_salt`'s: `salt_tenant`), unless `params.grammar`
        already holds it.
        """
        tenant = salt_tenant(cache_salt)
        self.validate(prompt_token_ids, params, tenant)
        if params.output_format is not None and params.grammar is None:  # the engine's own copy carries the grammar
            params = dataclasses.replace(params, grammar=await self.compiled_grammar(params, tenant))
        self.check_capacity()  # after the compile's wait: the count now, with no await before the handover
        request_id = request_id or f"req-{next(self._counter)}"
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority, cache_salt=cache_salt)
        self.handoff.submit(seq, OutputSink(asyncio.get_running_loop(), queue, seq), lambda: self.dead_reason)
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
                self._abort(request_id, seq)

    def abort(self, request_id: str) -> None:
        """Abort the request living under `request_id` now, if any (not one that reuses the id later)."""
        self._abort(request_id, None)

    def _abort(self, request_id: str, seq: Sequence | None) -> None:
        """Abort the request under `request_id`; with `seq`, only if it is that one: a stream left late, after its
        request ended and a new one took its id, aborts nothing. The request's place under the cap is free at once
        (`num_in_flight`); the loop ends it, and frees its blocks, at the start of its next step."""
        sink = self.handoff.sinks.get(request_id)  # without the lock: a dictionary look-up
        if sink is None or (seq is not None and sink.seq is not seq):
            return  # ended already, never handed over, or another request's id now: nothing to abort
        with self._aborting_lock:
            self._aborting[request_id] = sink.seq
        self.handoff.abort(request_id, sink.seq)  # only if it is still that request, asked under the lock
        self._wake.set()

    def stats(self) -> EngineStats:
        """A lock-free snapshot (see the module docstring): never waits for a step."""
        return self._counters.snapshot(self.scheduler, self.block_manager, self.speculative, self.handoff.num_waiting)

    # ---- engine side (loop thread) ----

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self.liveness.step_began()
                ran = self.step()
                self.liveness.step_ended()
                if not ran:
                    self._wake.wait(timeout=IDLE_WAIT_S)
                    self._counters.count_made(0)  # let an idle engine's tokens/s decay
        except BaseException as exc:
            log.exception("the engine loop died; every request in flight fails")
            self.handoff.end(f"{type(exc).__name__}: {exc}")
            return
        self.handoff.end("the engine was shut down")

    def step(self) -> bool:
        """One engine step; False when there was nothing to run."""
        self._drain_inbox()
        out = self.scheduler.schedule()
        if out.is_empty:
            return False
        t0 = time.perf_counter()
        try:
            speculated = None
            if self.speculative is not None and self.speculative.applies(out):
                speculated = self.speculative.run(out, self.block_manager, self.max_model_len)
            if speculated is None:
                token_ids = self.model_runner.run(out)
        except Exception as exc:
            log.exception("a forward pass failed; its %d sequences fail", len(out.seqs))
            for seq in out.seqs:
                self._fail(seq, f"{type(exc).__name__}: {exc}")
            return True
        step_s = time.perf_counter() - t0
        if speculated is not None:
            self._take_speculated(out, speculated, step_s)
            return True
        made = self.scheduler.postprocess(out, self._without_failed(out, token_ids))
        self._counters.account(out, step_s, len(made))
        for seq, token_id in made:
            self._stream_or_fail(seq, token_id)
        return True

    def _take_speculated(self, out: SchedulerOutput, speculated: list[list[int]], step_s: float) -> None:
        """Hand each sequence its tokens of a speculative step one at a time, as plain steps would: EOS, the length
        cap and stop strings end it at the token that reaches them, and the tokens after that are dropped. A sequence
        whose sampling raised in the step (the decoder's `last_errors`) made no token and fails alone."""
        made = 0
        errors = self.speculative.last_errors if self.speculative is not None else {}
        for seq, tokens in zip(out.seqs, speculated, strict=True):
            if seq.request_id in errors:
                log.error("sampling for %s failed in a speculative step: %s", seq.request_id, errors[seq.request_id])
                self._fail(seq, errors[seq.request_id])
                continue
            for token_id in tokens:
                if seq.is_finished:
                    break
                self.scheduler.append_token(seq, token_id)
                made += 1
                self._stream_or_fail(seq, token_id)
            if not seq.is_finished:  # every token but the newest has its K/V in the cache
                self.scheduler.computed_up_to(seq, seq.num_tokens - 1)
        self._counters.account(out, step_s, made)

    def _stream_or_fail(self, seq: Sequence, token_id: int) -> None:
        """Stream one made token; a sequence whose detokenizing raises fails alone."""
        try:
            self._stream(seq, token_id)
        except Exception as exc:
            log.exception("detokenizing %s failed; it alone fails", seq.request_id)
            self._fail(seq, f"{type(exc).__name__}: {exc}")

    def _drain_inbox(self) -> None:
        """Admit new requests to the scheduler, apply aborts."""
        inbox, aborts = self.handoff.take()
        for seq in inbox:
            self._seqs[seq.request_id] = seq
            self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
            self.scheduler.add_request(seq)
        for seq in aborts:
            if self._seqs.get(seq.request_id) is seq:  # not ended since (nor followed by another under its id)
                self.scheduler.finish(seq, "abort")
                self._release(seq)
                self._emit(seq, "", [], finished=True)

    def _without_failed(self, out: SchedulerOutput, token_ids: list[int]) -> list[int]:
        """Fail the sequences whose sampling raised (the runner's `last_errors`); the others' tokens, in order.

        A failed sequence is finished before postprocess, which then skips it without taking a token.
        """
        errors: dict[str, str] = self.model_runner.last_errors
        if not errors:
            return token_ids
        codes: dict[str, str] = self.model_runner.last_error_codes  # the request's own failures (its grammar)
        kept: list[int] = []
        sampled = iter(token_ids)
        for seq, do_sample in zip(out.seqs, out.do_sample, strict=True):
            if not do_sample:
                continue
            token_id = next(sampled)
            if seq.request_id in errors:
                code = codes.get(seq.request_id, "engine_error")
                if code == "engine_error":
                    log.error("sampling for %s failed: %s", seq.request_id, errors[seq.request_id])
                if seq.request_id in self.model_runner.last_grammar_limits and seq.params.grammar is not None:
                    self.grammars.ran_past_limits(seq.params.grammar.key, seq.tenant, errors[seq.request_id])
                self._fail(seq, errors[seq.request_id], code)
            else:
                kept.append(token_id)
        return kept

    def _stream(self, seq: Sequence, token_id: int) -> None:
        """Detokenize one new token, apply stop strings, send the output."""
        if seq.num_output_tokens == 1:
            self._counters.num_prompt_tokens_total += seq.num_prompt_tokens
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

    def _fail(self, seq: Sequence, reason: str, code: str = "engine_error") -> None:
        """End one sequence with an engine error: its blocks go back, its caller gets the error. `code` is
        "engine_error", or RESPONSE_FORMAT_FAILED when the request's own grammar could not go on."""
        if seq.request_id not in self._seqs and seq.request_id not in self.handoff.sinks:
            return  # already ended, released and answered
        self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"
        self._release(seq)
        self._counters.num_requests_failed += 1
        message = (f"response_format: the answer could not go on within the schema "
                   f"({reason.split(': ', 1)[-1]})"
                   if code == RESPONSE_FORMAT_FAILED else f"the engine failed on this request ({reason})")
        self._emit(seq, "", [], finished=True, error=message, error_code=code)

    def _release(self, seq: Sequence) -> None:
        if self._seqs.pop(seq.request_id, None) is None:
            return
        self._detok.pop(seq.request_id, None)
        self._counters.num_requests_finished += 1
        self.model_runner.release(seq.request_id)
        if self.speculative is not None:
            self.speculative.release(seq.request_id)

    def _emit(self, seq: Sequence, text: str, new_ids: list[int], *, finished: bool,
              logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None,
              error: str | None = None, error_code: str | None = None) -> None:
        sink = self.handoff.sink(seq.request_id, finished=finished)
        if sink is None:
            return
        sent = sink.send(RequestOutput(seq.request_id, text, new_ids, finished, seq.finish_reason,
                                       seq.num_prompt_tokens, seq.num_output_tokens, seq.busy_s,
                                       seq.num_cached_tokens, logprobs, error, error_code))
        if not sent and not finished:  # its caller's loop has closed: nobody reads on, so it stops as if aborted
            self.handoff.abort_later(seq)
