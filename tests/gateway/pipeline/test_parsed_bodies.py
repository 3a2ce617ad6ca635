"""A deterministic body sent again by the same key is parsed once (gateway/pipeline/parsed.py); each request gets
its own copy, a key never gets another key's, and what did not parse is parsed (and refused) at every try."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest

from cache.scope import CacheScope
from gateway import validation
from gateway.errors import InvalidRequest
from gateway.pipeline import cache_lookup
from gateway.pipeline.handle import parse_request
from gateway.pipeline.parsed import ParsedBodies
from tests.conftest import Gateway

request_key = importlib.import_module("cache.request_key")  # the modules (the package's names are functions)
semantic_cache = importlib.import_module("cache.semantic_cache")


def body(content: str = "What is 2+2?", **extra: object) -> bytes:
    return json.dumps({"model": "mid", "messages": [{"role": "user", "content": content}], "temperature": 0}
                      | extra).encode()


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, raw: bytes):  # type: ignore[no-untyped-def]
        self.calls += 1
        return parse_request(raw)


def test_a_repeat_by_the_same_key_is_parsed_once_and_gets_its_own_copy() -> None:
    parsed, parse = ParsedBodies(), Counting()
    first = parsed.parse("k1", parse, body())
    second = parsed.parse("k1", parse, body())
    assert parse.calls == 1
    assert second == first and second is not first
    second.user = "changed"  # a stage's assignment on its request stays its own
    assert parsed.parse("k1", parse, body()).user is None and first.user is None


def test_keys_bodies_and_parsers_are_kept_apart() -> None:
    parsed, parse, other = ParsedBodies(), Counting(), Counting()
    parsed.parse("k1", parse, body())
    parsed.parse("k2", parse, body())  # another key: parsed again, never handed k1's
    parsed.parse("k1", parse, body("What is 2+3?"))
    parsed.parse("k1", other, body())  # another parser (a text completion's reads the bytes otherwise)
    assert (parse.calls, other.calls) == (3, 1)


def test_what_the_cache_never_answers_or_did_not_parse_is_parsed_every_time() -> None:
    parsed, parse = ParsedBodies(max_body=400), Counting()
    sampled = json.dumps({"model": "mid", "messages": [{"role": "user", "content": "hi"}]}).encode()
    seeded = body(temperature=0.7, seed=3)
    long = body("x" * 500)
    for raw in (sampled, sampled, seeded, seeded, long, long):
        parsed.parse("k1", parse, raw)
    assert parse.calls == 5  # the seeded one is kept: the cache may answer it
    bad = body(max_tokens=-1)
    for _ in range(2):
        with pytest.raises(InvalidRequest):
            parsed.parse("k1", parse, bad)
    assert parse.calls == 7 and len(parsed) == 1


def test_the_least_recently_used_body_goes_first() -> None:
    parsed, parse = ParsedBodies(entries=2), Counting()
    a, b, c = body("a"), body("b"), body("c")
    for raw in (a, b, a, c):  # c pushes out b, the least recently used
        parsed.parse("k1", parse, raw)
    assert parse.calls == 3 and len(parsed) == 2
    parsed.parse("k1", parse, a)
    assert parse.calls == 3
    parsed.parse("k1", parse, b)
    assert parse.calls == 4


def test_an_exact_hit_through_the_api_does_not_parse_its_body_again(gateway: Gateway,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    parse_wire_body = validation.parse_wire_body

    def counting(raw: bytes, model: type) -> object:
        calls.append(model.__name__)
        return parse_wire_body(raw, model)

    monkeypatch.setattr(validation, "parse_wire_body", counting)
    request = {"model": "mid", "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "temperature": 0}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=request)
        second = c.post("/v1/chat/completions", json=request)
    assert first.status_code == second.status_code == 200
    assert second.json()["choices"] == first.json()["choices"]
    assert calls == ["ChatCompletionRequest"]


def test_what_is_derived_once_serves_a_repeat_until_a_field_is_assigned() -> None:
    parsed, parse = ParsedBodies(), Counting()
    first, derived = parsed.parse_kept("k1", parse, body())
    second, again = parsed.parse_kept("k1", parse, body())
    assert derived is not None and again is derived
    memo = derived.of(first)
    assert memo is not None and derived.of(second) is memo
    second.user = "changed"  # an assigned field: what was derived from the body is not this request's
    assert derived.of(second) is None and derived.of(first) is memo
    assert parsed.parse_kept("k2", parse, body())[1] is not derived  # another key's body: its own
    sampled = json.dumps({"model": "mid", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert parsed.parse_kept("k1", parse, sampled)[1] is None  # not kept: nothing derived once


def test_an_exact_hit_through_the_api_hashes_nothing_of_its_body_again(gateway: Gateway,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    digests = []
    digest = request_key._digest

    def counting(obj: object) -> str:
        digests.append(obj)
        return digest(obj)

    monkeypatch.setattr(request_key, "_digest", counting)
    request = {"model": "mid", "messages": [{"role": "user", "content": "What is the capital of Peru?"}],
               "temperature": 0}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=request)
        hashed = len(digests)
        second = c.post("/v1/chat/completions", json=request)
        # the same request in other bytes (its fields in another order): another body, hashed anew
        third = c.post("/v1/chat/completions", json=dict(reversed(request.items())))
    assert first.status_code == second.status_code == third.status_code == 200
    assert hashed >= 2  # the context hash and the exact key, at least
    assert [r.headers["x-tiergate-cache-kind"] for r in (second, third)] == ["exact", "exact"]
    assert second.json()["choices"] == third.json()["choices"] == first.json()["choices"]
    assert len(digests) == hashed + 2  # the second request's none; the third's context hash and exact key


def test_a_repeat_under_other_directives_or_in_another_scope_is_keyed_anew(gateway: Gateway,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    decided, scoped = [], []
    scope_id = CacheScope.scope_id

    def counting_decide(*args: Any, **kwargs: Any) -> Any:
        decided.append(args[0])
        return request_key.decide(*args, **kwargs)

    monkeypatch.setattr(cache_lookup, "decide", counting_decide, raising=False)  # (the code before: not there)
    monkeypatch.setattr(semantic_cache, "decide", counting_decide)
    monkeypatch.setattr(CacheScope, "scope_id", property(lambda s: scoped.append(s) or scope_id.fget(s)))
    request = {"model": "mid", "messages": [{"role": "user", "content": "What is the capital of Chile?"}],
               "temperature": 0}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=request)
        counts = len(decided), len(scoped)
        second = c.post("/v1/chat/completions", json=request)
        assert (len(decided), len(scoped)) == counts  # a repeat in the same scope: nothing decided or hashed again
        no_cache = c.post("/v1/chat/completions", json=request, headers={"Cache-Control": "no-cache"})
        assert len(decided) > counts[0]  # other directives: decided anew, not the repeat's "cacheable"
        other = c.post("/v1/chat/completions", json=request, headers={"X-Tiergate-Data-Version": "v2"})
        assert len(scoped) > counts[1]  # another scope: its id hashed anew
    assert [r.status_code for r in (first, second, no_cache, other)] == [200] * 4
    assert [r.headers["x-tiergate-cache"] for r in (first, second, no_cache, other)] == ["miss", "hit", "bypass",
                                                                                           "miss"]
