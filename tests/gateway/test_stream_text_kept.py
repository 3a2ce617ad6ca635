"""A tier's answer is relayed piece by piece; the meter keeps its whole text only where something reads it once the
answer ends (an Idempotency-Key's stored answer here; the cache's store, the cascade's check, a shadow), through a
real gateway. A long stream's pieces were all held for the request's life, read by nothing, whatever the request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.pipeline.meter import Meter, Outcome
from tests.conftest import Gateway
from tests.gateway.scripted_upstream import DONE, Script, chunk
from tests.gateway.test_billing_usage_reported import MSG, settled
from tests.gateway.test_billing_usage_reported import env as billed_env

env = billed_env  # a gateway whose tier `mid` is the scripted upstream; its plan's cache is off
PIECES = [f" w{i}" for i in range(2000)]


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The characters of text each attempt's meter held when its outcome was taken."""
    seen: list[int] = []
    outcome = Meter.outcome

    def spied(self: Meter, *args: Any, **kwargs: Any) -> Outcome:
        seen.append(sum(map(len, self._parts)))
        return outcome(self, *args, **kwargs)

    monkeypatch.setattr(Meter, "outcome", spied)
    return seen


def ask(gw: Gateway, *, stream: bool, headers: dict[str, str] | None = None) -> str:
    body = {"model": "mid", "messages": MSG, "max_tokens": 4000, "stream": stream}
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_nothing_reads_again_is_not_kept_whole(env: tuple[Gateway, Script], held: list[int],
                                                         stream: bool) -> None:
    gw, script = env
    script.lines = [chunk(p) for p in PIECES] + [chunk(finish="stop"), DONE]
    assert ask(gw, stream=stream) == "".join(PIECES)  # the client's answer is whole (a JSON one: the route's own)
    row, _, _ = settled(gw)
    assert held == [0]  # was the whole answer, 2000 pieces
    assert row.output_tokens == len(PIECES)  # billed a token a chunk, as before


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_kept_under_an_idempotency_key_is_kept_whole(env: tuple[Gateway, Script], held: list[int],
                                                               stream: bool) -> None:
    gw, script = env
    script.lines = [chunk(p) for p in PIECES[:50]] + [chunk(finish="stop"), DONE]
    key = {"Idempotency-Key": f"order-{stream}"}
    assert ask(gw, stream=stream, headers=key) == "".join(PIECES[:50])
    settled(gw)
    assert held == [len("".join(PIECES[:50]))]
    script.lines = [chunk("other"), chunk(finish="stop"), DONE]
    assert ask(gw, stream=stream, headers=key) == "".join(PIECES[:50])  # the replay: the stored answer, whole
