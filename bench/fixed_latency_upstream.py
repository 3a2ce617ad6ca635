"""An OpenAI-compatible upstream whose cost per request does not depend on load.

First token after `ttft_s`, then one token every `tpot_s`. With the engine's own contention taken out,
what a benchmark in front of it measures is the gateway's queueing alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from litestar import Litestar, Request, get, post
from litestar.response import Stream


def fixed_latency_app(ttft_s: float, tpot_s: float) -> Litestar:
    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fixed", "object": "model"}]}

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Stream:
        body = json.loads(await request.body())
        return Stream(_tokens(body.get("max_tokens") or 16, ttft_s, tpot_s), media_type="text/event-stream")

    return Litestar([models, chat])


async def _tokens(n: int, ttft_s: float, tpot_s: float) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        data = {"id": "x", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(data)}\n\n".encode()

    await asyncio.sleep(ttft_s)
    for i in range(n):
        if i:
            await asyncio.sleep(tpot_s)
        yield chunk({"content": f" t{i}"}, usage={"prompt_tokens": 10, "completion_tokens": i + 1,
                                                 "total_tokens": 11 + i})
    yield chunk({}, "length")
    yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 10, 'completion_tokens': n}})}\n\n".encode()
    yield b"data: [DONE]\n\n"
