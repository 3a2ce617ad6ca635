"""Through the HTTP API, a cached answer never answers a request the tier would read otherwise: system messages
moved to another place in the conversation, another speaker's `name` on the last turn, a raw prompt whose line
ends differ (cache/request_key.py; tests/cache/test_request_key_as_sent.py has the keys themselves)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Gateway
from tests.gateway.test_cache_api import upstream_calls, wait_for_stores

GERMAN = {"role": "system", "content": "From now on answer ONLY in German."}
OPENING = [{"role": "system", "content": "Answer in English."},
           {"role": "user", "content": "Translate 'cat' to French."}, {"role": "assistant", "content": "chat"}]
DOG = {"role": "user", "content": "And 'dog'?"}


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        r = c.post(path, json={"model": "mid", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    wait_for_stores(gw)
    return r


def chat(gw: Gateway, *messages: dict[str, Any]) -> httpx.Response:
    return post(gw, "/v1/chat/completions", {"messages": list(messages)})


def test_a_system_message_moved_elsewhere_in_the_conversation_misses(gateway: Gateway) -> None:
    assert chat(gateway, *OPENING, GERMAN, DOG).headers["x-tiergate-cache"] == "miss"
    assert chat(gateway, OPENING[0], GERMAN, *OPENING[1:], DOG).headers["x-tiergate-cache"] == "miss"
    assert chat(gateway, *OPENING, GERMAN, DOG).headers["x-tiergate-cache"] == "hit"  # the repeat is still served
    assert upstream_calls(gateway) == 2
    sent = [r["messages"] for r in gateway.stub.requests]
    assert [m["role"] for m in sent[0]] == ["system", "user", "assistant", "system", "user"]  # as sent, in place
    assert [m["role"] for m in sent[1]] == ["system", "system", "user", "assistant", "user"]


def test_another_speaker_on_the_last_turn_misses(gateway: Gateway) -> None:
    def ask(who: str) -> httpx.Response:
        return chat(gateway, {"role": "system", "content": "Group chat. Greet the speaker by their name."},
                    {"role": "user", "name": who, "content": "Hi, what is my name?"})

    assert ask("alice").headers["x-tiergate-cache"] == "miss"
    bob = ask("bob")
    assert bob.headers["x-tiergate-cache"] == "miss", bob.headers.get("x-tiergate-cache-similarity")
    assert ask("alice").headers["x-tiergate-cache"] == "hit"
    assert upstream_calls(gateway) == 2 and gateway.stub.requests[1]["messages"][-1]["name"] == "bob"


def test_a_raw_prompt_with_other_line_ends_misses(gateway: Gateway) -> None:
    def complete(prompt: str) -> httpx.Response:
        return post(gateway, "/v1/completions", {"prompt": prompt})

    assert complete("Line one\r\nLine two\r\n").headers["x-tiergate-cache"] == "miss"
    lf = complete("Line one\nLine two\n")
    assert lf.headers["x-tiergate-cache"] == "miss", lf.headers.get("x-tiergate-cache-kind")
    assert complete("Line one\r\nLine two\r\n").headers["x-tiergate-cache"] == "hit"
    assert [r["prompt"] for r in gateway.stub.requests] == ["Line one\r\nLine two\r\n", "Line one\nLine two\n"]
