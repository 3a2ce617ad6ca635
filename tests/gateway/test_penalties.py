"""OpenAI's `presence_penalty` and `frequency_penalty` through the gateway: every tier's server takes both (OpenAI's,
vLLM's, llama.cpp's), so each tier gets them as they were sent, left out where 0; a value out of [-2, 2] or of
another type is a 400 naming the field before anything is spent; and the cache never answers a request with an
answer made under other penalties, exactly or by meaning. Through a real gateway in front of a stub that records
the bodies it gets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PLANS_YAML, Gateway, running_gateway
from tests.gateway.test_cache_api import ask
from tests.stubs import ServerThread, StubState, openai_tiers, stub_app, write_settings

TIERS = {"small": {"dialect": "vllm"}, "mid": {"dialect": "openai"}, "full": {"dialect": "vllm-priority"}}
USER = [{"role": "user", "content": "hello"}]
ENDPOINTS = [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hello"})]


@pytest.fixture
def gw(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    state = StubState()
    with ServerThread(stub_app(state)).start() as stub:
        tiers = openai_tiers({name: {**own, "url": stub.url} for name, own in TIERS.items()})
        with running_gateway(write_settings(tmp_path, prepared_models, tiers, PLANS_YAML), state) as gateway:
            yield gateway


def post(gw: Gateway, path: str, body: dict[str, Any]) -> Any:
    with gw.client(gw.tenant_key) as c:
        return c.post(path, json={"max_tokens": 3, **body})


@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=["chat", "text"])
def test_every_tier_gets_the_penalties_as_sent(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    for tier in TIERS:
        r = post(gw, path, {"model": tier, "presence_penalty": 0.5, "frequency_penalty": -1.25, **body})
        assert r.status_code == 200, r.text
        sent = gw.stub.requests[-1]
        assert sent["model"] == f"stub-{tier}"
        assert (sent["presence_penalty"], sent["frequency_penalty"]) == (0.5, -1.25)


@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=["chat", "text"])
def test_a_zero_penalty_is_left_out(gw: Gateway, path: str, body: dict[str, Any]) -> None:
    r = post(gw, path, {"model": "mid", "presence_penalty": 0, "frequency_penalty": 0.0, **body})
    assert r.status_code == 200, r.text
    assert "presence_penalty" not in gw.stub.requests[-1] and "frequency_penalty" not in gw.stub.requests[-1]
    r = post(gw, path, {"model": "mid", "frequency_penalty": 2, **body})  # an integer is a number
    assert r.status_code == 200 and gw.stub.requests[-1]["frequency_penalty"] == 2.0, r.text


def test_a_bad_penalty_is_a_400_naming_it_before_anything_is_sent(gw: Gateway) -> None:
    for path, body in ENDPOINTS:
        for field in ("presence_penalty", "frequency_penalty"):
            for value in (2.5, -3, "0.5", True):
                r = post(gw, path, {"model": "mid", field: value, **body})
                assert r.status_code == 400, (path, field, value, r.text)
                error = r.json()["error"]
                assert error["param"] == field and error["type"] == "invalid_request_error", error
                assert error["message"].startswith(f"{field}: "), error
    assert gw.stub.requests == [] and gw.ledger_rows() == []


PENALTIES = [{"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"frequency_penalty": 1.0},
             {"frequency_penalty": 0.5, "presence_penalty": 0.5}, {"presence_penalty": -0.5}]


def test_the_exact_cache_keeps_each_penalty_its_own_answer(gw: Gateway) -> None:
    question = "List three uses of a paperclip."
    assert ask(gw, question).headers["x-tiergate-cache"] == "miss"
    for penalties in PENALTIES:  # neither the answer without penalties nor one under other penalties
        calls = len(gw.stub.requests)
        assert ask(gw, question, **penalties).headers["x-tiergate-cache"] == "miss", penalties
        assert len(gw.stub.requests) == calls + 1
        assert ask(gw, question, **penalties).headers["x-tiergate-cache"] == "hit", penalties
        assert len(gw.stub.requests) == calls + 1
    assert ask(gw, question).headers["x-tiergate-cache"] == "hit"
    assert {k: v for k, v in gw.stub.requests[-1].items() if k.endswith("_penalty")} == {"presence_penalty": -0.5}


def test_a_zero_penalty_is_an_exact_hit_for_none(gw: Gateway) -> None:
    """A zero penalty is no penalty (the tier gets neither field: `test_a_zero_penalty_is_left_out`), so the answer
    kept without penalties answers it, and it keeps its answer for the request without them."""
    assert ask(gw, "Name a prime.").headers["x-tiergate-cache"] == "miss"
    assert ask(gw, "What colour is the sky on Mars?", presence_penalty=0, frequency_penalty=-0.0).headers[
        "x-tiergate-cache"] == "miss"
    calls = len(gw.stub.requests)
    for question, penalties in [("Name a prime.", {"presence_penalty": 0}), ("Name a prime.", {"frequency_penalty": 0}),
                                ("What colour is the sky on Mars?", {})]:
        r = ask(gw, question, **penalties)
        assert (r.headers["x-tiergate-cache"], r.headers["x-tiergate-cache-kind"]) == ("hit", "exact"), penalties
    assert len(gw.stub.requests) == calls
    assert ask(gw, "Name a prime.", presence_penalty=0.5).headers["x-tiergate-cache"] == "miss"
    assert gw.stub.requests[-1]["presence_penalty"] == 0.5


def test_the_semantic_cache_never_answers_under_other_penalties(gw: Gateway) -> None:
    paraphrase = "What's the capital of France?"
    assert ask(gw).headers["x-tiergate-cache"] == "miss"
    assert ask(gw, paraphrase).headers["x-tiergate-cache-kind"] == "semantic"  # it would hit without penalties
    for penalties in PENALTIES:
        assert ask(gw, **penalties).headers["x-tiergate-cache"] == "miss", penalties  # stored under them
    for penalties in PENALTIES:  # each paraphrase finds only its own penalties' answer
        calls = len(gw.stub.requests)
        hit = ask(gw, paraphrase, **penalties)
        assert hit.headers["x-tiergate-cache-kind"] == "semantic" and len(gw.stub.requests) == calls, penalties
    other = ask(gw, paraphrase, frequency_penalty=-1.0)  # no answer under these: the tier answers
    assert other.headers["x-tiergate-cache"] == "miss"
