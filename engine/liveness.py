"""Whether a running engine is wedged: what /health reports besides a stopped loop (LLMEngine.health_problem).

A loop that is alive but wedged serves no one while its thread still runs, so `dead_reason` is None; the supervisor
restarts an engine only if /health says it is not ok. Two things wedge it: one step running far past any honest one
(a forward pass hung in a native call: every request waits behind it), and one grammar compile using far more CPU
than any honest one (a compile thread cannot be stopped, so each wedged one holds one of the compile queue's few
threads for good). Read without the engine's lock, as its `stats`: never waits on a step.
"""

from __future__ import annotations

import time

from engine.compile_queue import CompileQueue

# One step running longer than this is a wedged loop (a forward pass hung in a native call), not a slow one: the
# slowest honest step, a 512-token prompt chunk late in an 8K context on one shared core, takes a few seconds
STUCK_STEP_S = 30.0
# A grammar compile that has used more CPU than this is wedged: llguidance's compiles are bounded (milliseconds, a few
# seconds of CPU for the worst schemas the wire lets through), and a thread cannot be stopped, so each wedged one holds
# one of the compile queue's few threads for good. CPU, not wall time: compile threads yield to the steps
# (engine/compile_queue.py), so a busy engine's compile may wait minutes without being wedged
STUCK_COMPILE_S = 60.0


class Liveness:
    """The engine loop's step in progress and its compile queue's longest compile, against their bounds."""

    def __init__(self, compiles: CompileQueue, *, stuck_after_s: float = STUCK_STEP_S,
                 compile_stuck_after_s: float = STUCK_COMPILE_S) -> None:
        """`stuck_after_s`, `compile_stuck_after_s`: how long one step may run, and how much CPU one grammar compile
        may use, before `problem` calls the engine wedged."""
        self.stuck_after_s = stuck_after_s
        self.compile_stuck_after_s = compile_stuck_after_s
        self._compiles = compiles
        self._step_began: float | None = None  # when the step running now began (None between steps)

    def step_began(self) -> None:
        """The loop thread starts a step."""
        self._step_began = time.monotonic()

    def step_ended(self) -> None:
        """The loop thread's step is over."""
        self._step_began = None

    def problem(self) -> str | None:
        """Why the running engine is wedged, or None: one step has run past `stuck_after_s`, or a grammar compile has
        used more than `compile_stuck_after_s` of CPU."""
        began = self._step_began
        if began is not None and (held := time.monotonic() - began) > self.stuck_after_s:
            return f"the engine loop has been in one step for {held:.0f}s (wedged)"
        if (used := self._compiles.longest_running_cpu_s()) > self.compile_stuck_after_s:
            return f"a grammar compile has used {used:.0f}s of CPU (wedged)"
        return None
