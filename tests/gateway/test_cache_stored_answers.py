"""Which fresh answers the cache keeps, through the HTTP API: a whole answer only. An answer the upstream ended early
(aborted, filtered, no finish at all), an empty one, or one cut at an output cap the client did not ask for (the
gateway's `default_max_tokens`, or the room its context left) is served once and never to a repeat."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from gateway.settings import Settings
from tests.conftest import PLANS_YAML, Gateway, running_gateway
from tests.gateway.test_cache_api import ask
from tests.stubs import REPLY, ServerThread, StubState, health_routes, openai_tiers, write_settings

WHOLE = "The answer is 42."


def scripted_app(state: StubState, script: list[tuple[str, str | None]]) -> Litestar:
    """An upstream that answers each chat with the next (text, finish_reason) of `script` (None: the stream ends
    with no finish reason), then with WHOLE and `stop`."""

    async def events(body: dict[str, Any], text: str, finish: str | None) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
            data = {"id": "s", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
            return f"data: {json.dumps(data)}\n\n".encode()

        yield chunk({"role": "assistant", "content": ""})
        if text:
            yield chunk({"content": text})
        if finish is not None:
            yield chunk({}, finish)
        n = len(text.split())
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        yield f"data: {json.dumps({'id': 's', 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        body = json.loads(await request.body())
        state.requests.append(body)
        text, finish = script.pop(0) if script else (WHOLE, "stop")
        return Stream(events(body, text, finish), media_type="text/event-stream")

    return Litestar([*health_routes(), chat])


@pytest.fixture
def scripted(tmp_path: Path, prepared_models: Path) -> Iterator[tuple[Gateway, list[tuple[str, str | None]]]]:
    state, script = StubState(), []
    with ServerThread(scripted_app(state, script)).start() as upstream:
        tiers = openai_tiers({"small": {}, "mid": {}, "full": {}}, url=upstream.url, model="stub")
        with running_gateway(write_settings(tmp_path, prepared_models, tiers, PLANS_YAML), state) as gw:
            yield gw, script


@pytest.mark.parametrize(("text", "finish"), [
    ("The answer is", "abort"),  # vLLM's, for a sequence it aborted (preempted, out of memory)
    ("The answer is", "content_filter"),
    ("The answer is", None),  # the stream ended with no finish reason
    ("", "stop"),  # empty
    ("  \n", "stop"),  # nothing but whitespace
])
def test_an_answer_that_is_not_whole_is_not_kept(scripted: tuple[Gateway, list], text: str,
                                                 finish: str | None) -> None:
    gw, script = scripted
    script.append((text, finish))
    first = ask(gw)
    assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == text
    repeat = ask(gw)
    assert repeat.headers["x-tiergate-cache"] == "miss"  # not the first answer again
    assert repeat.json()["choices"][0]["message"]["content"] == WHOLE and len(gw.stub.requests) == 2
    third = ask(gw)  # the whole answer is kept as before
    assert third.headers["x-tiergate-cache"] == "hit" and third.json()["choices"][0]["message"]["content"] == WHOLE


def test_an_answer_cut_at_the_gateways_default_cap_is_not_kept(gateway_settings: Settings,
                                                               stub: tuple[ServerThread, StubState]) -> None:
    """The stub answers REPLY cut at max_tokens words (finish `length`). Gateway 1 sends a request without
    max_tokens a cap of 3 (its default); gateway 2, on the same store with the default cap, must not serve that cut
    answer to the same request: it asks the tier and gets the whole answer."""
    with running_gateway(gateway_settings.model_copy(update={"default_max_tokens": 3}), stub[1]) as gw:
        cut = ask(gw)
        choice = cut.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == ("Hello from the", "length")
        assert ask(gw).headers["x-tiergate-cache"] == "miss"  # nor to a repeat on the same gateway
    with running_gateway(gateway_settings, stub[1]) as gw:
        whole = ask(gw)
        assert whole.headers["x-tiergate-cache"] == "miss" and whole.json()["choices"][0]["message"]["content"] == REPLY
        assert ask(gw).headers["x-tiergate-cache"] == "hit"  # the whole one is kept
    assert [r["max_tokens"] for r in stub[1].requests] == [3, 3, 1024]


def test_an_answer_cut_at_the_clients_own_max_tokens_is_kept(gateway: Gateway) -> None:
    """max_tokens is in the cache key: the cut answer is the whole answer to that request."""
    cut = ask(gateway, max_tokens=3)
    assert cut.json()["choices"][0]["finish_reason"] == "length"
    repeat = ask(gateway, max_tokens=3)
    assert repeat.headers["x-tiergate-cache"] == "hit" and repeat.json()["choices"][0]["finish_reason"] == "length"
    assert repeat.json()["choices"][0]["message"]["content"] == "Hello from the"
    other = ask(gateway, max_tokens=4)  # another cap is another request
    assert other.headers["x-tiergate-cache"] == "miss" and len(gateway.stub.requests) == 2


def test_a_streamed_answer_ended_early_is_not_kept(scripted: tuple[Gateway, list]) -> None:
    gw, script = scripted
    script.append(("The answer is", "abort"))
    body = {"model": "mid", "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and "The answer is" in r.text
    repeat = ask(gw)
    assert repeat.headers["x-tiergate-cache"] == "miss" and repeat.json()["choices"][0]["message"]["content"] == WHOLE
