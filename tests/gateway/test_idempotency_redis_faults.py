"""Idempotency-Key records in Redis (replicas without a database) through HTTP, when Redis fails: a claim Redis
refuses is a retryable 503 that runs and charges nothing; an answer Redis refuses to store is still delivered (JSON,
and a stream to its [DONE]), charged once, and the SDK's retry with its key gets it again instead of a second
billed run, on this replica at once and on another one once Redis answers again. Faults are injected by wrapping
the live store's scripts."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
from redis.exceptions import TimeoutError as RedisTimeout

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.stubs import REPLY, ServerThread, StubState

MSG = [{"role": "user", "content": "hello there"}]


def store_of(gw: Gateway) -> Any:
    return gw.app.state.services.pipeline.idempotency.store


def refusing(script: Any) -> Any:
    async def call(**kwargs: Any) -> Any:
        raise RedisTimeout("Timeout reading from 127.0.0.1:6379")
    call.real = script  # type: ignore[attr-defined]
    return call


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_redis_refusing_a_claim_is_a_retryable_503_that_runs_and_charges_nothing(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str) -> None:
    with running_gateway(gateway_settings.model_copy(update={"redis_url": redis_url}), stub[1]) as gw:
        store = store_of(gw)
        store._begin = refusing(store._begin)
        with gw.client(gw.tenant_key) as c:
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                       headers={"idempotency-key": "order-1"})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "idempotency_unavailable" and error["type"] == "service_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            assert gw.stub.requests == [] and gw.ledger_rows() == []  # nothing run or charged
            store._begin = store._begin.real  # Redis is back: the retry runs, once
            r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG},
                       headers={"idempotency-key": "order-1"})
            assert r.status_code == 200, r.text
        assert len(gw.stub.requests) == 1 and len(gw.ledger_rows()) == 1


def test_an_answer_redis_refuses_to_store_is_delivered_and_its_retry_is_not_billed_again(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str, tmp_path: Any) -> None:
    a_settings = gateway_settings.model_copy(update={"redis_url": redis_url})
    b_settings = a_settings.model_copy(update={"data_dir": tmp_path / "b"})
    with (running_gateway(a_settings, stub[1]) as a, running_gateway(b_settings, stub[1]) as b,
          sdk(a.url, a.tenant_key) as client, sdk(b.url, b.tenant_key) as other):
        store = store_of(a)
        store._finish = refusing(store._finish)
        first = client.chat.completions.create(model="mid", messages=MSG, extra_headers={"Idempotency-Key": "json"})
        assert first.choices[0].message.content == REPLY  # answered, not a 500
        with a.client(a.tenant_key) as c, c.stream(
                "POST", "/v1/chat/completions", json={"model": "mid", "messages": MSG, "stream": True},
                headers={"idempotency-key": "sse"}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"  # the stream is not cut
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text.split() == REPLY.split()
        # the SDK's retry on this replica: the answer again, not a second run
        raw = client.chat.completions.with_raw_response.create(model="mid", messages=MSG,
                                                               extra_headers={"Idempotency-Key": "json"})
        assert raw.headers["x-tiergate-idempotent-replay"] == "true" and raw.parse().id == first.id
        assert len(a.stub.requests) == 2 and len(a.ledger_rows()) == 2  # one run, one row each
        store._finish = store._finish.real  # Redis takes writes again: the owed answers land
        deadline = time.monotonic() + 10
        while True:
            raw = other.chat.completions.with_raw_response.create(
                model="mid", messages=MSG, extra_headers={"Idempotency-Key": "json"})
            if raw.headers.get("x-tiergate-idempotent-replay") == "true":
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert raw.parse().id == first.id
        assert len(a.stub.requests) == 2 and b.ledger_rows() == []  # replica b ran nothing
