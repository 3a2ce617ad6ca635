"""Idempotency-Key through HTTP with the official OpenAI client: an answer lost on the way back is replayed
to the SDK's retry with the same id and usage, charged once (JSON and stream); another body with the same key
is a 422; a retry while the first runs waits for it or gets a 409; a failed answer is not stored; a replica
that did not serve the first request replays it (Redis); a tenant holding as many keys as it may is refused a new
one before any work, others are not. Every test runs with the records in SQLite (embedded)
and in PostgreSQL (a fleet's database)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import Settings
from quotas.idempotency import Limits
from tests.conftest import Gateway, running_gateway
from tests.fault_proxy import DroppingProxy
from tests.stubs import REPLY, ServerThread, StubState
from wire.completion_request import DEFAULT_MAX_TOKENS

MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture(params=["sqlite", "postgres"])
def gateway_settings(request: pytest.FixtureRequest, gateway_settings: Settings) -> Settings:
    """conftest's settings, with the ledger and the idempotency records in the data directory or in PostgreSQL."""
    if request.param == "sqlite":
        return gateway_settings
    return gateway_settings.model_copy(update={"database_url": request.getfixturevalue("database_url")})


@pytest.fixture
def proxy(gateway: Gateway) -> Iterator[DroppingProxy]:
    p = DroppingProxy(int(gateway.url.rsplit(":", 1)[1])).start()
    yield p
    p.stop()


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=30)


def spent(gateway: Gateway) -> Any:
    return sum(r.price_usd for r in gateway.ledger_rows())


def test_a_lost_answer_is_replayed_to_the_retry_and_charged_once(gateway: Gateway, proxy: DroppingProxy) -> None:
    with sdk(proxy.url, gateway.tenant_key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="mid", messages=MSG, extra_headers={"Idempotency-Key": "order-42"})
        out = raw.parse()
    assert proxy.dropped == 1  # the first answer was lost, the SDK retried
    assert raw.headers["x-tiergate-idempotent-replay"] == "true"
    assert out.choices[0].message.content == REPLY and out.usage.completion_tokens == len(REPLY.split())
    (row,) = gateway.ledger_rows()  # one run, one row, charged once
    assert out.id == f"chatcmpl-{row.request_id}" and row.output_tokens == out.usage.completion_tokens
    assert len(gateway.stub.requests) == 1
    with sdk(gateway.url, gateway.tenant_key) as client:
        again = client.chat.completions.create(  # later retries: the same answer
            model="mid", messages=MSG, extra_headers={"Idempotency-Key": "order-42"})
    assert again.id == out.id and len(gateway.ledger_rows()) == 1


def test_a_lost_stream_is_replayed_as_a_stream(gateway: Gateway, proxy: DroppingProxy) -> None:
    with sdk(proxy.url, gateway.tenant_key) as client:
        stream = client.chat.completions.create(model="mid", messages=MSG, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_headers={"Idempotency-Key": "stream-1"})
        chunks = list(stream)
    assert proxy.dropped == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == REPLY and usage is not None and usage.completion_tokens == len(REPLY.split())
    (row,) = gateway.ledger_rows()
    assert {c.id for c in chunks} == {f"chatcmpl-{row.request_id}"}
    assert len(gateway.stub.requests) == 1


def test_the_same_key_with_another_body_is_a_422(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                       headers={"idempotency-key": "k"})
        other = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "x"}]},
                       headers={"idempotency-key": "k"})
    assert first.status_code == 200
    assert other.status_code == 422 and other.json()["error"]["param"] == "Idempotency-Key"
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(gateway.ledger_rows()) == 1


def test_a_key_used_for_a_text_completion_is_not_replayed_to_a_chat(gateway: Gateway) -> None:
    """The two routes' requests can dump alike (a text completion is carried as one user turn): the route is part
    of what a key stands for."""
    with gateway.client(gateway.tenant_key) as c:
        text = c.post("/v1/completions", json={"model": "mid", "prompt": "hello there"},
                      headers={"idempotency-key": "k"})
        chat = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG,
                                                    "max_tokens": DEFAULT_MAX_TOKENS},
                      headers={"idempotency-key": "k"})
    assert text.status_code == 200, text.text
    assert chat.status_code == 422 and chat.json()["error"]["code"] == "idempotency_key_reused"
    assert len(gateway.ledger_rows()) == 1


def test_keys_are_per_tenant_and_malformed_keys_are_refused(gateway: Gateway) -> None:
    gateway.store.create_tenant("other", "standard")
    _, other_key = gateway.store.issue_key("other")
    with gateway.client(gateway.tenant_key) as mine, gateway.client(other_key) as theirs:
        a = mine.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}, headers={"idempotency-key": "k"})
        b = theirs.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                        headers={"idempotency-key": "k"})
        assert a.status_code == b.status_code == 200
        assert "x-tiergate-idempotent-replay" not in b.headers and a.json()["id"] != b.json()["id"]
        bad = mine.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                        headers={"idempotency-key": "x" * 300})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_idempotency_key"


def test_a_retry_while_the_first_runs_waits_for_it_or_gets_a_409(gateway: Gateway) -> None:
    slow = {"model": "mid", "messages": [{"role": "user", "content": "STUB:slow"}]}
    results: dict[str, httpx.Response] = {}

    def post(key: str, name: str) -> None:
        with gateway.client(gateway.tenant_key) as c:
            results[name] = c.post("/v1/chat/completions", json=slow, headers={"idempotency-key": key})

    first = threading.Thread(target=post, args=("slow", "first"))
    first.start()
    time.sleep(0.4)
    post("slow", "waited")  # waits (the default bound is 10 s) and gets the replay
    first.join()
    assert results["waited"].status_code == 200
    assert results["waited"].headers["x-tiergate-idempotent-replay"] == "true"
    assert results["waited"].json()["id"] == results["first"].json()["id"]

    gateway.app.state.services.pipeline.idempotency.wait_s = 0.1
    first = threading.Thread(target=post, args=("slow-2", "first"))
    first.start()
    time.sleep(0.4)
    post("slow-2", "busy")
    first.join()
    busy = results["busy"]
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "idempotency_key_in_use"
    assert busy.headers["retry-after"] == "1" and results["first"].status_code == 200
    assert len(gateway.stub.requests) == 2  # each key ran once


def test_an_answer_that_failed_is_not_stored(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for _ in range(2):
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user",
                                                                                    "content": "STUB:400"}]},
                       headers={"idempotency-key": "fails"})
            assert r.status_code == 400 and "x-tiergate-idempotent-replay" not in r.headers
    assert len(gateway.stub.requests) == 2  # the retry ran again


def test_a_replica_that_did_not_serve_the_first_request_replays_it(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str, tmp_path: Any) -> None:
    a_settings = gateway_settings.model_copy(update={"redis_url": redis_url})
    b_settings = gateway_settings.model_copy(update={"redis_url": redis_url, "data_dir": tmp_path / "b"})
    with running_gateway(a_settings, stub[1]) as a, running_gateway(b_settings, stub[1]) as b:
        with sdk(a.url, a.tenant_key) as client_a, sdk(b.url, b.tenant_key) as client_b:
            first = client_a.chat.completions.create(
                model="mid", messages=MSG, extra_headers={"Idempotency-Key": "fleet-1"})
            raw = client_b.chat.completions.with_raw_response.create(
                model="mid", messages=MSG, extra_headers={"Idempotency-Key": "fleet-1"})
        assert raw.headers["x-tiergate-idempotent-replay"] == "true" and raw.parse().id == first.id
        # one row, in a's ledger (each replica has its own file), or in the fleet's (the same for both)
        assert len(a.ledger_rows()) == 1 and len(b.ledger_rows()) == (1 if a_settings.database_url else 0)


def test_replays_count_against_the_request_rate(gateway: Gateway) -> None:
    """A replay costs no tokens or money and writes no row, but it is a request: free replays of a stored answer
    of megabytes were a flood no limit saw."""
    gateway.store.create_tenant("capped", "metered")  # 3 requests per minute
    _, key = gateway.store.issue_key("capped")
    with gateway.client(key) as c:
        answers = [c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                          headers={"Idempotency-Key": "same"}) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert [r.headers.get("x-tiergate-idempotent-replay") for r in answers[:3]] == [None, "true", "true"]
    assert answers[3].json()["error"]["code"] == "rate_limit_rpm"
    assert len([r for r in gateway.ledger_rows() if r.tenant == "capped"]) == 1 and len(gateway.stub.requests) == 1


def test_a_tenant_at_its_bound_of_keys_is_refused_a_new_one_before_any_work(gateway: Gateway) -> None:
    """Each key stores a copy of its answer for the plan's TTL: fresh keys on a free cached answer filled the ledger's
    disk. At the bound a new key is a 429 that charges, calls and stores nothing; held keys and other tenants answer."""
    store = gateway.app.state.services.pipeline.idempotency.store
    store.limits = Limits(records=2)
    gateway.store.create_tenant("other", "standard")
    _, other_key = gateway.store.issue_key("other")
    body = {"model": "mid", "messages": MSG}
    with gateway.client(gateway.tenant_key) as mine, gateway.client(other_key) as theirs:
        held = [mine.post("/v1/chat/completions", json=body, headers={"idempotency-key": f"k{i}"}) for i in range(2)]
        assert [r.status_code for r in held] == [200, 200]
        refused = mine.post("/v1/chat/completions", json=body, headers={"idempotency-key": "k2"})
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "idempotency_key_limit" and error["param"] == "Idempotency-Key"
        assert 86_000 < int(refused.headers["retry-after"]) <= 86_400  # when its first key's answer expires
        assert len(gateway.ledger_rows()) == 2 and len(gateway.stub.requests) == 2  # nothing charged or called
        replay = mine.post("/v1/chat/completions", json=body, headers={"idempotency-key": "k0"})
        assert replay.status_code == 200 and replay.headers["x-tiergate-idempotent-replay"] == "true"
        assert mine.post("/v1/chat/completions", json=body).status_code == 200  # without a key: served
        assert theirs.post("/v1/chat/completions", json=body, headers={"idempotency-key": "k2"}).status_code == 200
        store.limits = Limits(records=3)  # room again: the refused key was never held (another body is no 422)
        other = mine.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "x"}]},
                          headers={"idempotency-key": "k2"})
        assert other.status_code == 200 and "x-tiergate-idempotent-replay" not in other.headers
    assert len(gateway.ledger_rows()) == 5


def test_a_retry_of_an_answer_too_large_to_keep_is_told_so_and_not_run_again(gateway: Gateway) -> None:
    """An answer over the store's bound for one answer (4 MiB: a long answer with top log-probabilities passes it)
    is answered but not stored; its key is still kept as answered, so the SDK's retry with it is told so (409
    `idempotency_answer_not_kept`, no Retry-After: waiting does not help) and is neither run nor billed again.
    Before, its claim was given up and the retry ran and was billed a second time: one key, two runs. The records in
    SQLite and in PostgreSQL here; the stores' own tests have Redis too (tests/quotas/test_idempotency_store.py)."""
    gateway.app.state.services.pipeline.idempotency.store.limits = Limits(answer_bytes=100)  # any answer passes it
    body = {"model": "mid", "messages": MSG}
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=body, headers={"idempotency-key": "big"})
        assert first.status_code == 200, first.text
        retry = c.post("/v1/chat/completions", json=body, headers={"idempotency-key": "big"})
        other = c.post("/v1/chat/completions", json={**body, "max_tokens": 3}, headers={"idempotency-key": "big"})
    assert retry.status_code == 409, retry.text
    error = retry.json()["error"]
    assert error["code"] == "idempotency_answer_not_kept" and error["param"] == "Idempotency-Key", error
    assert "retry-after" not in retry.headers and "new key" in error["message"]
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert len(gateway.ledger_rows()) == 1, "the key ran and was billed more than once"
