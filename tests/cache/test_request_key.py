"""Exact keys, history, cacheability rules."""

from __future__ import annotations

import pytest

from cache import decide, request_key
from cache.request_key import (
    CACHE_CONTROL_MAX_CHARS,
    CACHE_CONTROL_MAX_ELEMENTS,
    CacheControlRefused,
    context_hash,
    parse_cache_control,
    sampling_class,
)
from tests.cache.conftest import chat


def test_exact_key_is_the_text_as_sent_line_ends_included() -> None:
    a = request_key(chat("What is 2+2?\r\n"))
    assert a.exact_key != request_key(chat("What is 2+2?\n")).exact_key  # the tier gets CRLF
    assert a.exact_key != request_key(chat("What is 2+2?")).exact_key  # whitespace is kept: test_sent_text.py
    assert a.exact_key != request_key(chat("What is  2+2?\n")).exact_key
    assert a.exact_key != request_key(chat("what is 2+2?\n")).exact_key
    assert a.exact_key != request_key(chat("What is 2+3?\n")).exact_key


def test_exact_key_covers_every_turn_not_only_the_last() -> None:
    h1 = [{"role": "user", "content": "Temperatures in Paris"}, {"role": "assistant", "content": "20 C"}]
    h2 = [{"role": "user", "content": "Temperatures in Rome"}, {"role": "assistant", "content": "20 C"}]
    a, b = request_key(chat("And in Fahrenheit?", history=h1)), request_key(chat("And in Fahrenheit?", history=h2))
    assert a.last_user_text == b.last_user_text == "And in Fahrenheit?"
    assert a.exact_key != b.exact_key
    assert a.history_hash != b.history_hash


def test_one_text_part_is_compared_as_its_text_but_keyed_as_a_part() -> None:
    parts = chat("x")
    parts["messages"][-1]["content"] = [{"type": "text", "text": "Hello there"}]
    key, plain = request_key(parts), request_key(chat("Hello there"))
    assert key.last_user_text == plain.last_user_text == "Hello there"  # every tier reads one part as its text
    # a remote tier gets the part, not the string: another request, and another partition of the semantic layer
    assert key.exact_key != plain.exact_key and key.history_hash != plain.history_hash


def test_system_prompt_goes_to_context_and_exact_key_output_params_to_context() -> None:
    # the scope tells system prompts apart; the exact key has every message where it was sent (F1)
    assert request_key(chat("q", system="A")).exact_key != request_key(chat("q", system="B")).exact_key
    assert context_hash(chat("q", system="A")) != context_hash(chat("q", system="B"))
    assert request_key(chat("q", max_tokens=3)).exact_key == request_key(chat("q")).exact_key
    assert context_hash(chat("q")) != context_hash(chat("q", max_tokens=3))


def test_sampling_class() -> None:
    assert sampling_class(chat("q")) == "greedy"
    assert sampling_class(chat("q", temperature=0.7, seed=3)) == "seed:3:temperature=0.7:top_p=unset:top_k=unset"
    assert sampling_class(chat("q", temperature=1, seed=3, top_p=1, top_k=5)) == \
        "seed:3:temperature=1.0:top_p=1.0:top_k=5"  # numbers as floats: 1 is the JSON number 1.0
    assert sampling_class({"messages": [], "seed": 3}) == "seed:3:temperature=unset:top_p=unset:top_k=unset"
    assert sampling_class({"messages": []}) == "sampled"  # OpenAI's default temperature is 1
    seeded = chat("q", temperature=0.8, seed=1, top_k=5)
    assert sampling_class(seeded) != sampling_class({**seeded, "top_k": 50})  # vLLM's top_k changes the sample


def test_only_deterministic_requests_are_cacheable() -> None:
    assert decide(chat("q")).reason == "cacheable"
    d = decide(chat("q", temperature=0.7))
    assert d.bypass and d.reason == "bypass: temperature>0 without seed"
    assert decide(chat("q", temperature=0.7, seed=1)).store
    assert decide(chat("q", n=2)).reason == "bypass: n>1"
    assert decide(chat("q", logprobs=True, top_logprobs=3)).reason == "bypass: logprobs"  # stored: text only
    assert decide(chat("q", logprobs=False)).reason == "cacheable"


def test_tools_with_side_effects_bypass_unless_declared_pure() -> None:
    tools = [{"type": "function", "function": {"name": "send_email", "parameters": {}}}]
    d = decide(chat("q", tools=tools))
    assert d.bypass and "send_email" in d.reason
    assert decide(chat("q", tools=tools), pure_tools={"send_email"}).lookup
    assert decide(chat("q", tools=tools, tool_choice="none")).lookup


def test_cache_control_headers() -> None:
    d = decide(chat("q"), {"Cache-Control": "no-cache"})
    assert (d.lookup, d.store) == (False, True)
    d = decide(chat("q"), {"cache-control": "no-store"})
    assert (d.lookup, d.store) == (True, False)
    d = decide(chat("q"), {"cache-control": "no-store, no-cache"})
    assert d.bypass
    d = decide(chat("q"), {"cache-control": "max-age=0"})  # no stored answer is fresh enough: no-cache
    assert (d.lookup, d.store) == (False, True)
    with pytest.raises(CacheControlRefused, match="'max-age=60'"):  # refused by name, never dropped
        decide(chat("q"), {"cache-control": "max-age=60"})


def test_cache_control_is_read_in_bounded_work() -> None:
    """Tenant input: at most CACHE_CONTROL_MAX_CHARS characters and CACHE_CONTROL_MAX_ELEMENTS list elements (empty
    ones, which are ignored, counted), each split once."""
    assert parse_cache_control(" NO-cache ,, no-store ") == {"no-cache", "no-store"}
    assert parse_cache_control(", ".join(["no-cache"] * CACHE_CONTROL_MAX_ELEMENTS)) == {"no-cache"}
    with pytest.raises(CacheControlRefused, match="more than 8"):
        parse_cache_control("," * CACHE_CONTROL_MAX_ELEMENTS)
    with pytest.raises(CacheControlRefused, match="at most 256"):
        parse_cache_control("no-cache" + " " * CACHE_CONTROL_MAX_CHARS)
    with pytest.raises(CacheControlRefused, match=r"'xxxx.*\.\.\.' is not honoured"):  # a long name shown cut
        parse_cache_control("x" * 200)


def test_keys_stay_those_entries_were_stored_under() -> None:
    """The keys of a request with every kind of field a hash reads (non-ASCII text, CRLF, a name, tool calls, a
    content part, floats, nested parameters out of order), pinned to what KEY_VERSION "k3" computed when they were
    written: a faster encoding of the same hashes must give the same bytes, or every stored entry is unreachable."""
    req = {"model": "auto", "temperature": 0, "max_tokens": 64, "stop": ["\n\n"], "presence_penalty": 0.5,
           "response_format": {"type": "json_object"},
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2.5}}}],
           "messages": [{"role": "system", "content": "Réponds en français, s'il te plaît ✓"},
                        {"role": "user", "content": "Quelle est la température à Paris ?\r\n", "name": "alice"},
                        {"role": "assistant", "content": None,
                         "tool_calls": [{"id": "c1", "type": "function",
                                         "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "content": "20 °C", "tool_call_id": "c1"},
                        {"role": "user", "content": [{"type": "text", "text": "Et à Rome ? 2³"}]}]}
    key = request_key(req)
    assert key.exact_key == "98724eaf1f7c1486e06dd88ab2c44af2"
    assert key.history_hash == "ee596d36478c82bf99d7315c8c6732ed"
    assert context_hash(req) == "2815d61fd6844b8eedd8bad54fd9be1a"
