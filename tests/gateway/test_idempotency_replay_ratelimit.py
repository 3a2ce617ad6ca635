"""A chat or completions Idempotency-Key replay takes a place in the tenant's request rate (handle.py's
`_count_replay`), so it tells the tenant its `x-ratelimit-*` headers, as a fresh answer and an embeddings replay do:
its own, counted after the place it took, never the first answer's stored again. It sent none, and a client pacing
itself by them saw a request that used a place and said nothing. JSON and streamed replays alike."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.settings import Settings
from tests.conftest import running_gateway
from tests.stubs import ServerThread, StubState

MSG = [{"role": "user", "content": "hi"}]
ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "mid", "messages": MSG}),
    "chat-stream": ("/v1/chat/completions", {"model": "mid", "messages": MSG, "stream": True}),
    "completions": ("/v1/completions", {"model": "mid", "prompt": "hi"}),
}


def limits(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("x-ratelimit-")}


@pytest.mark.parametrize("route", ROUTES)
def test_a_replay_tells_its_own_rate_limit_headers(gateway_settings: Settings, stub: tuple[ServerThread, StubState],
                                                   route: str) -> None:
    path, body = ROUTES[route]
    with running_gateway(gateway_settings, stub[1], plan="metered") as gw, gw.client(gw.tenant_key) as c:  # rpm 3
        first = c.post(path, json=body, headers={"Idempotency-Key": "r"})
        replay = c.post(path, json=body, headers={"Idempotency-Key": "r"})
    assert first.status_code == replay.status_code == 200, (first.text, replay.text)
    assert "x-tiergate-idempotent-replay" not in first.headers
    assert replay.headers["x-tiergate-idempotent-replay"] == "true"
    assert replay.headers["content-type"] == first.headers["content-type"]  # a stream replayed as a stream
    assert len(stub[1].requests) == 1  # the replay ran nothing
    told, again = limits(first.headers), limits(replay.headers)
    assert told["x-ratelimit-limit-requests"] == "3" and told["x-ratelimit-remaining-requests"] == "2"
    assert again.keys() == told.keys()  # the same headers (requests and tokens), the replay's own counts:
    assert again["x-ratelimit-limit-requests"] == "3" and again["x-ratelimit-remaining-requests"] == "1"
