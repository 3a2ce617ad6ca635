"""A quota store whose settle fails once the request's ledger row is durable: the client still gets its answer, billed
once by that row, and the quota's spend ends at the row's price, its reservation and slot freed: the settle is retried
in the background (quotas/reservations.py `QuotaService.settle`). Before, the failure reached the client as a 5xx (a 503
`quota_backend_unavailable`, "retry shortly", on the embedded store; a 500 on Redis for a fault its own retries, of
`RedisError`s, do not catch) for an answer produced and billed: a retry without an Idempotency-Key (the OpenAI SDK
retries 5xx by itself) ran and was billed again (with a key it was replayed, billed once, after a 503), and the quota
held the reservation's upper bound and its concurrency slot until the reaper billed it from the row at the end of its
lease (15 minutes by default). Chat (JSON and streamed), embeddings, and Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cache_api import wait_for_stores
from tests.gateway.test_idempotency_ledger_late import embed, wait_until, warm_embeddings
from tests.gateway.test_settle_late_row import spent_pico
from tests.stubs import ServerThread, StubState

REPLAY = "x-tiergate-idempotent-replay"


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1]) as gateway:  # the default lease: no reaper within the test
        yield gateway


def chat(gw: Gateway, key: str | None, *, stream: bool = False) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", headers={"idempotency-key": key} if key else {},
                   json={"model": "mid", "messages": [{"role": "user", "content": "hello there"}], "stream": stream})
    wait_for_stores(gw)
    return r


def rows_of(gw: Gateway, rid: str) -> list[tuple[str, int, bool]]:
    return [(row.status, row.http_status, row.price_usd > 0) for row in gw.ledger_rows() if row.request_id == rid]


def billed_pico(gw: Gateway) -> int:
    return sum(int(row.price_usd * 10**12) for row in gw.ledger_rows())


def failing_once(monkeypatch: pytest.MonkeyPatch, backend: MemoryBackend) -> list[str]:
    """The embedded store's settle raising on its first call (an outage's error), then as it was; each call's fate."""
    real, calls = backend.settle_now, []

    def settle_now(req: Any, **kw: Any) -> None:
        if not calls:
            calls.append("raised")
            raise QuotaBackendError("redis: secret detail of the store")
        calls.append("settled")
        real(req, **kw)

    monkeypatch.setattr(backend, "settle_now", settle_now)
    return calls


@pytest.mark.parametrize("key", [None, "settle-fails"])
def test_a_settle_that_fails_after_the_row_is_durable_leaves_the_answer_billed_once(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch, key: str | None) -> None:
    backend = gw.app.state.services.quota_backend
    assert isinstance(backend, MemoryBackend)
    spent = spent_pico(backend)
    calls = failing_once(monkeypatch, backend)
    r = chat(gw, key)
    assert calls[:1] == ["raised"]
    assert r.status_code == 200, f"a 5xx for an answer produced and billed: {r.text}"
    assert "secret" not in r.text
    assert r.json()["choices"][0]["message"]["content"]
    rid = r.headers["x-tiergate-request-id"]
    assert rows_of(gw, rid) == [("ok", 200, True)]
    wait_until(lambda: not backend._held, timeout_s=10)  # the settle retried: the reservation and its slot freed
    assert calls == ["raised", "settled"]
    assert spent_pico(backend) - spent == billed_pico(gw), "the quota's spend is not the row's price"
    if key is not None:  # the client's retry with its key replays the answer: billed nothing more
        again = chat(gw, key)
        assert again.status_code == 200 and again.headers.get(REPLAY) == "true", again.text
        assert len(gw.ledger_rows()) == 1 and len(gw.stub.requests) == 1
        assert spent_pico(backend) - spent == billed_pico(gw)


def test_a_stream_whose_settle_fails_ends_as_it_was_answered(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = gw.app.state.services.quota_backend
    assert isinstance(backend, MemoryBackend)
    spent = spent_pico(backend)
    calls = failing_once(monkeypatch, backend)
    r = chat(gw, None, stream=True)
    assert r.status_code == 200
    assert '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert rows_of(gw, r.headers["x-tiergate-request-id"]) == [("ok", 200, True)]
    wait_until(lambda: not backend._held, timeout_s=10)
    assert calls == ["raised", "settled"]
    assert spent_pico(backend) - spent == billed_pico(gw)


def test_an_embeddings_answer_whose_settle_fails_is_answered_and_billed_once(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embeddings route settles its quota through the same `QuotaService.settle` (gateway/embeddings_settle.py)."""
    warm_embeddings(gw)
    backend = gw.app.state.services.quota_backend
    assert isinstance(backend, MemoryBackend)
    wait_until(lambda: not backend._held, timeout_s=10)
    spent, billed = spent_pico(backend), billed_pico(gw)
    calls = failing_once(monkeypatch, backend)
    r = embed(gw, "embeddings-settle-fails")
    assert calls[:1] == ["raised"]
    assert r.status_code == 200, f"a 5xx for an answer produced and billed: {r.text}"
    assert rows_of(gw, r.headers["x-tiergate-request-id"]) == [("ok", 200, True)]
    wait_until(lambda: not backend._held, timeout_s=10)
    assert calls == ["raised", "settled"]
    assert spent_pico(backend) - spent == billed_pico(gw) - billed > 0


class Bug(RuntimeError):
    """A fault that is not a store's error (a bug; on Redis, one the backend's own retries, of `RedisError`s, miss)."""


def redis_state(url: str) -> tuple[int, int]:
    """The tenant's money spent today in Redis, and its reservations held (leases), read with a client of the test's."""
    async def read() -> tuple[int, int]:
        backend = RedisBackend(url)
        try:
            spent = await backend.spent("acme", ["t"], time.time())
            assert spent is not None
            return spent["t"][0], int(await backend.redis.zcard(backend.leases_key("acme")))
        finally:
            await backend.close()
    return asyncio.run(read())


def test_on_redis_a_settle_that_raises_is_retried_and_the_answer_stands(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = gateway_settings.model_copy(update={"redis_url": redis_url})
    with running_gateway(settings, stub[1]) as gw:
        backend = gw.app.state.services.quota_backend
        assert isinstance(backend, FailoverBackend) and isinstance(backend.primary, RedisBackend)
        real, calls = backend.primary._finish, []

        async def finish(req: Any, **kw: Any) -> int:
            if kw.get("kind") == "settle" and not calls:
                calls.append("raised")
                raise Bug("secret detail of the client")
            calls.append(kw.get("kind", ""))
            return await real(req, **kw)

        monkeypatch.setattr(backend.primary, "_finish", finish)
        r = chat(gw, None)
        assert calls[:1] == ["raised"]
        assert r.status_code == 200, f"a 5xx for an answer produced and billed: {r.text}"
        assert rows_of(gw, r.headers["x-tiergate-request-id"]) == [("ok", 200, True)]
        wait_until(lambda: redis_state(redis_url)[1] == 0, timeout_s=10)  # settled in Redis: no reservation held
        assert calls == ["raised", "settle"]
        assert redis_state(redis_url)[0] == billed_pico(gw), "Redis' spend is not the row's price"


def gate_fails_once(quotas: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`quotas` telling the gate a reservation settled raises the first time; the tenants it was told of, listed."""
    real, calls = quotas.on_settled, []

    def on_settled(tenant: str, scopes: tuple[str, ...]) -> None:
        if not calls:
            calls.append(tenant)
            raise Bug("secret detail of the gate")
        real(tenant, scopes)

    monkeypatch.setattr(quotas, "on_settled", on_settled)
    return calls


def test_a_quota_settle_that_raises_past_its_store_leaves_the_answer_billed_once(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in the quota settle past its store (what it tells the gate once settled) is logged by the settle stage,
    never the client's error: the row is durable, the answer billed (gateway/pipeline/settle.py)."""
    backend, quotas = gw.app.state.services.quota_backend, gw.app.state.services.pipeline.settler.quotas
    assert isinstance(backend, MemoryBackend)
    spent, calls = spent_pico(backend), gate_fails_once(quotas, monkeypatch)
    r = chat(gw, None)
    assert calls == ["acme"]
    assert r.status_code == 200, f"a 5xx for an answer produced and billed: {r.text}"
    assert rows_of(gw, r.headers["x-tiergate-request-id"]) == [("ok", 200, True)]
    assert not backend._held and spent_pico(backend) - spent == billed_pico(gw)


def test_an_embeddings_quota_settle_that_raises_past_its_store_leaves_the_answer_billed_once(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fault on the embeddings route: its settle (gateway/embeddings_settle.py) logs it once the row is
    durable, never the client's error; the answer is billed once and kept under its Idempotency-Key for a retry."""
    warm_embeddings(gw)
    backend, quotas = gw.app.state.services.quota_backend, gw.app.state.services.pipeline.settler.quotas
    assert isinstance(backend, MemoryBackend)
    wait_until(lambda: not backend._held, timeout_s=10)
    spent, billed, calls = spent_pico(backend), billed_pico(gw), gate_fails_once(quotas, monkeypatch)
    r = embed(gw, "embeddings-gate-fails")
    assert calls == ["acme"]
    assert r.status_code == 200, f"a 5xx for an answer produced and billed: {r.text}"
    assert rows_of(gw, r.headers["x-tiergate-request-id"]) == [("ok", 200, True)]
    assert not backend._held and spent_pico(backend) - spent == billed_pico(gw) - billed > 0
    again = embed(gw, "embeddings-gate-fails")  # the retry with its key replays the answer: billed nothing more
    assert again.status_code == 200 and again.headers.get(REPLAY) == "true", again.text
    assert billed_pico(gw) - billed == spent_pico(backend) - spent
