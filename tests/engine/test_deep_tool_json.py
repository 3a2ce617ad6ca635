"""Tool-call JSON nested near Python's recursion limit: `json.loads` read it, and writing it back (`json.dumps`, a few
frames deeper on the stack) raised RecursionError, a 500 that counted against the replica's breaker. Both ways in: an
earlier call's arguments in the request (rendered into the prompt), and a call the model writes (an echo prompt
steers it). Which depths failed depends on the stack under the call, so each test tries every depth near the limit."""

from __future__ import annotations

import sys

import httpx

from engine.tool_calls import ToolAnswer
from tests.engine.test_server_hostile import MSG, TOOLS, serve, still_serves
from wire.chat_request import ChatCompletionRequest

SPAN = 300  # depths tried, up to the recursion limit: the failing ones were 15-30 under it (100 over HTTP)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def depths(span: int = SPAN) -> range:
    limit = sys.getrecursionlimit()
    return range(limit - span, limit + 1)


def test_a_past_call_with_deeply_nested_arguments_is_served() -> None:
    server, eng, _ = serve("ok")
    try:
        failed = {}
        for depth in depths(100):
            history = [*MSG, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": nested(depth)}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]
            r = httpx.post(f"{server.url}/v1/chat/completions",
                           json={"model": "tiny", "messages": history, "max_tokens": 1})
            if r.status_code != 200:
                failed[depth] = r.status_code
        assert not failed  # were 500s at 984 and 985 (recursion limit 1000)
        still_serves(server.url, eng)
    finally:
        server.stop()
        eng.shutdown()


def test_a_call_the_model_nests_too_deeply_to_write_back_is_text() -> None:
    free = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "tools": TOOLS})
    required = free.model_copy(update={"tool_choice": "required"})
    for depth in depths():
        call = f'{{"name": "f", "arguments": {{"a": {nested(depth)}}}}}'
        text = f"<tool_call>{call}</tool_call>"
        content, calls, _ = ToolAnswer(free).whole(text, "stop")  # raised RecursionError: a 500
        assert (content, calls) == (text, None) or calls is not None, depth
        streamed = ToolAnswer(free)
        streamed.feed(text)
        streamed.finish("stop")  # the stream's last event was an error
        content, calls, _ = ToolAnswer(required).whole(call, "stop")
        assert (content, calls) == (call, None) or calls is not None, depth
