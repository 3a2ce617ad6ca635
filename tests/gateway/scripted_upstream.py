"""A scripted OpenAI-compatible upstream for money probes: each request's SSE lines come from `Script.next`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from tests.stubs import StubState, health_routes


def chunk(content: str | None = None, *, finish: str | None = None, usage: dict[str, Any] | None = None,
          choices: bool = True, **extra: Any) -> bytes:
    """One `data:` event: a chat chunk with `content` (or none), its finish reason and usage, and `extra` fields."""
    data: dict[str, Any] = {"id": "s", "object": "chat.completion.chunk", "created": 0, "model": "remote", **extra}
    data["choices"] = [{"index": 0, "delta": {"content": content} if content is not None else {},
                        "finish_reason": finish}] if choices else []
    if usage is not None:
        data["usage"] = usage
    return f"data: {json.dumps(data)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class Script:
    def __init__(self) -> None:
        self.lines: list[bytes | float] = []  # bytes sent, or a float: seconds slept
        self.state = StubState()


def scripted_app(script: Script) -> Litestar:
    async def events(lines: list[bytes | float]) -> AsyncIterator[bytes]:
        try:
            for line in lines:
                if isinstance(line, float):
                    await asyncio.sleep(line)
                else:
                    yield line
            script.state.finished.append("done")
        except (asyncio.CancelledError, GeneratorExit):
            script.state.finished.append("disconnected")
            raise

    @post("/v1/chat/completions", status_code=200)
    async def answer(request: Request[Any, Any, Any]) -> Response[Any]:
        script.state.requests.append(json.loads(await request.body()))
        return Stream(events(list(script.lines)), media_type="text/event-stream")

    return Litestar([*health_routes("remote"), answer])
