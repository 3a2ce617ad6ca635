"""Where a request's outputs go: a queue read on its caller's event loop, filled from the engine loop's thread.

The engine registers one `OutputSink` a request (LLMEngine.generate) and hands it each output as it is made; the
caller's async iterator reads the queue. A caller whose event loop has closed is gone: `send` says so, and the
engine stops its request as if aborted, instead of the hand-over raising in the engine's thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.sequence import Sequence


@dataclass
class OutputSink:
    """Where a request's outputs go: a queue read on its caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]
    seq: Sequence

    def send(self, out: RequestOutput) -> bool:
        """Hand `out` to the caller's event loop (thread-safe); False when that loop has closed: the caller is gone.

        The call itself is the check: the loop can close between `is_closed()` and the call, which then raises
        RuntimeError in the engine's thread, and one departed caller ended the loop for every request (from `_fail`,
        called inside an `except`, nothing caught it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True
