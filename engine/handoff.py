"""What crosses between the engine's callers (their event loops) and its loop thread, under one lock.

Callers hand over new requests, each with its output sink (engine/output_sink.py), and aborts; the loop takes them
at the start of each step (`take`), so an abort takes effect within one step, and finds each request's sink as it
emits. When the loop ends, `end` refuses new requests from then on and answers every request in flight with
`engine_dead` at once. The lock is held for a few list and dictionary operations, never across a step;
`num_waiting` and `dead_reason` are read without it (stats and /health never wait).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.output_sink import OutputSink
from engine.outputs import RequestOutput
from engine.sampling_params import EngineInputError
from engine.sequence import Sequence


class EngineDeadError(RuntimeError):
    """The engine's loop has stopped: nothing more will be generated; maps to HTTP 503."""


class Handoff:
    """The inbox of new requests, the aborts, the output sinks by request id, and why the loop stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        # the requests to abort, each the very request asked for: a new one reusing the id of one that ended is not it
        self._aborts: list[Sequence] = []
        self.sinks: dict[str, OutputSink] = {}
        self.dead_reason: str | None = None  # set by `end`

    @property
    def num_waiting(self) -> int:
        """Requests handed over and not taken by the loop yet (read without the lock)."""
        return len(self._inbox)

    # ---- callers ----

    def submit(self, seq: Sequence, sink: OutputSink, dead_reason: Callable[[], str | None]) -> None:
        """Hand `seq` to the loop, its outputs to go to `sink`. EngineDeadError once the loop has stopped
        (`dead_reason`, asked under the lock: a request handed over as the loop ends is refused, never left
        unanswered), EngineInputError while a request runs under its id."""
        with self._lock:
            if (reason := dead_reason()) is not None:
                raise EngineDeadError(f"the engine has stopped: {reason}")
            if seq.request_id in self.sinks:
                raise EngineInputError(f"request id {seq.request_id!r} is already running", param="request_id")
            self.sinks[seq.request_id] = sink
            self._inbox.append(seq)

    def abort(self, request_id: str, seq: Sequence | None) -> None:
        """Abort the request under `request_id`; with `seq`, only if it is that one."""
        with self._lock:
            sink = self.sinks.get(request_id)
            if sink is not None and (seq is None or sink.seq is seq):
                self._aborts.append(sink.seq)

    # ---- the loop ----

    def take(self) -> tuple[list[Sequence], list[Sequence]]:
        """The requests handed over and the aborts asked for since the last take."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        return inbox, aborts

    def sink(self, request_id: str, *, finished: bool) -> OutputSink | None:
        """The request's sink, if it is still answered; taken away with its last output (`finished`)."""
        with self._lock:
            return self.sinks.pop(request_id, None) if finished else self.sinks.get(request_id)

    def abort_later(self, seq: Sequence) -> None:
        """Stop `seq` at the next step as if aborted (its caller is gone)."""
        with self._lock:
            self._aborts.append(seq)

    def end(self, reason: str) -> None:
        """The loop is over: refuse new requests and end every one in flight with `engine_dead`, at once."""
        with self._lock:
            self.dead_reason = reason
            sinks = list(self.sinks.values())
            self.sinks.clear()
            self._inbox.clear()
        for sink in sinks:
            seq = sink.seq
            sink.send(RequestOutput(seq.request_id, "", [], True, "error", seq.num_prompt_tokens,
                                    seq.num_output_tokens, seq.busy_s, seq.num_cached_tokens,
                                    error=f"the engine has stopped: {reason}", error_code="engine_dead"))
