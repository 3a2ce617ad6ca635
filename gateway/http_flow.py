"""Flow control for the gateway's HTTP protocol (gateway/http_refusals.py): uvicorn's, with reading that can be
held for good, so that a client's bytes behind a refusal stop being read until its connection closes."""

from __future__ import annotations

from uvicorn.protocols.http.flow_control import FlowControl


class HeldFlow(FlowControl):
    """uvicorn's flow control, whose reading can be paused for good (`hold`): uvicorn resumes reading as each answer
    ends and as the app waits on its request's body, which would undo a plain pause."""

    held = False

    def hold(self) -> None:
        """Read nothing more from this connection (until it closes)."""
        self.held = True
        self.pause_reading()

    def resume_reading(self) -> None:
        if not self.held:
            super().resume_reading()
