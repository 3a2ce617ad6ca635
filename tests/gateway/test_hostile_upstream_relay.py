"""What a tenant is sent, and billed, when its tier's stream breaks the request the gateway sent it, through a real
gateway: a tier that streams past `max_tokens`, or for ever, has the answer end at the cap (finish_reason "length"),
the rest never relayed nor billed; a choice the tenant did not ask for (index 1: `n` is 1) is not its answer. Before,
everything the tier streamed was relayed (and held whole for a JSON answer), the bill alone capped."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Gateway
from tests.gateway.scripted_upstream import DONE, Script, chunk
from tests.gateway.test_billing_usage_reported import MSG, settled
from tests.gateway.test_billing_usage_reported import env as billed_env

env = billed_env  # a gateway whose tier `mid` is the scripted upstream, billed by the plan `billed`


def ask(gw: Gateway, *, stream: bool, max_tokens: int) -> tuple[str, str | None, dict[str, Any] | None]:
    """The text the tenant got, its finish reason and the usage it was told."""
    body = {"model": "mid", "messages": MSG, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        answer = r.json()
        return answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"], answer["usage"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not [e for e in events if "error" in e], r.text
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    finish = next((c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")), None)
    return text, finish, next((e["usage"] for e in events if e.get("usage")), None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tier_streaming_past_max_tokens_is_cut_at_the_cap(env: tuple[Gateway, Script], stream: bool) -> None:
    gw, script = env
    script.lines = [chunk(f"w{i} ") for i in range(10)] + [chunk(finish="stop"), DONE]
    text, finish, told = ask(gw, stream=stream, max_tokens=3)
    assert (text, finish) == ("w0 w1 w2 ", "length")
    row, _, _ = settled(gw)
    assert row.output_tokens == 3 and told is not None and told["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_tier_streaming_for_ever_is_cut_at_the_cap(env: tuple[Gateway, Script], stream: bool) -> None:
    # no [DONE], and more chunks than the client's own bound on a stream (tiers.client.CHUNKS_PER_TOKEN): a kilobyte a
    # chunk, it never ends as far as the tenant is concerned
    gw, script = env
    script.lines = [chunk("x" * 1000) for _ in range(2000)]
    text, finish, _ = ask(gw, stream=stream, max_tokens=8)
    assert (len(text), finish) == (8000, "length")
    row, _, _ = settled(gw)
    assert row.output_tokens == 8 and row.status == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_a_chunk_of_more_characters_than_the_cap_allows_is_not_relayed(env: tuple[Gateway, Script],
                                                                       stream: bool) -> None:
    gw, script = env
    script.lines = [chunk("ok "), chunk("y" * 500_000), chunk(finish="stop"), DONE]  # one "token" of 500,000
    text, finish, _ = ask(gw, stream=stream, max_tokens=4)
    assert (text, finish) == ("ok ", "length")
    row, _, _ = settled(gw)
    assert row.output_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_the_tenant_did_not_ask_for_is_not_its_answer(env: tuple[Gateway, Script], stream: bool) -> None:
    gw, script = env
    other = b'data: {"choices": [{"index": 1, "delta": {"content": "INJECTED"}, "finish_reason": null}]}\n\n'
    script.lines = [chunk("The"), other, chunk(" end"), chunk(finish="stop"), DONE]
    text, finish, _ = ask(gw, stream=stream, max_tokens=10)
    assert (text, finish) == ("The end", "stop")
    row, _, _ = settled(gw)
    assert row.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_the_held_back_end_after_the_last_token_is_relayed(env: tuple[Gateway, Script], stream: bool) -> None:
    # an OpenAI-compatible server that holds back the answer's end (a stop string's partial match) sends it with its
    # finish reason after its last token's chunk: within what was paid for. It was cut at the cap: the tenant lost
    # the end, told "length"
    gw, script = env
    script.lines = [chunk(f"w{i} ") for i in range(3)] + [chunk("end.", finish="stop"), DONE]
    text, finish, told = ask(gw, stream=stream, max_tokens=3)
    assert (text, finish) == ("w0 w1 w2 end.", "stop")
    row, _, _ = settled(gw)
    assert row.output_tokens == 3 and told is not None and told["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_calls_last_arguments_after_the_last_token_are_relayed(env: tuple[Gateway, Script],
                                                                      stream: bool) -> None:
    gw, script = env
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
    end = {"index": 0, "function": {"arguments": "1}"}}

    def line(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()

    script.lines = [chunk("a"), chunk("b"), line({"tool_calls": [call]}), line({"tool_calls": [end]}, "tool_calls"),
                    DONE]
    body = {"model": "mid", "messages": MSG, "max_tokens": 2, "stream": stream,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        args = "".join(t["function"].get("arguments") or "" for e in events for ch in e["choices"]
                       for t in ch["delta"].get("tool_calls") or ())
    else:
        args = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert args == '{"a": 1}'
