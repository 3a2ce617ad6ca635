"""An Idempotency-Key's claim through a real gateway, past its lease and past the ledger's readiness: a claim whose
answer runs longer than the lease (a slow stream) is renewed while it runs, so a retry with its key waits for it
and is replayed its answer, never runs and is charged a second time; a stored answer is replayed while the ledger
cannot write (a replay writes no row), while a new key is still refused with 503 and runs nothing. Every test runs
with the records in SQLite (embedded) and in PostgreSQL (a fleet's database)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway

SLOW = {"model": "mid", "messages": [{"role": "user", "content": "STUB:slow"}]}  # six words, 0.2 s apart
MSG = {"model": "mid", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(params=["sqlite", "postgres"])
def gateway_settings(request: pytest.FixtureRequest, gateway_settings: Settings) -> Settings:
    """conftest's settings, with the ledger and the idempotency records in the data directory or in PostgreSQL."""
    if request.param == "sqlite":
        return gateway_settings
    return gateway_settings.model_copy(update={"database_url": request.getfixturevalue("database_url")})


def test_a_claim_running_past_its_lease_is_renewed_and_a_retry_is_not_run_again(gateway: Gateway) -> None:
    gateway.app.state.services.pipeline.idempotency.lease_s = 0.5  # the answer takes 1.2 s: more than two leases
    results: dict[str, httpx.Response] = {}

    def post(name: str) -> None:
        with gateway.client(gateway.tenant_key) as c:
            results[name] = c.post("/v1/chat/completions", json={**SLOW, "stream": True},
                                   headers={"idempotency-key": "long-stream"})

    first = threading.Thread(target=post, args=("first",))
    first.start()
    time.sleep(0.9)  # the first claim's lease, had it not been renewed, ended 0.4 s ago
    post("retry")  # waits for the first (the default bound is 10 s) and is replayed its answer
    first.join()
    assert results["first"].status_code == results["retry"].status_code == 200
    assert results["retry"].headers.get("x-tiergate-idempotent-replay") == "true"
    assert len(gateway.stub.requests) == 1  # one upstream call
    (row,) = gateway.ledger_rows()  # one charge
    assert f"chatcmpl-{row.request_id}" in results["retry"].text


def test_a_stored_answer_is_replayed_while_the_ledger_cannot_write_and_new_work_is_not(
        gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    with gateway.client(gateway.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=MSG, headers={"idempotency-key": "paid"})
        assert first.status_code == 200
        ledger = gateway.app.state.services.ledger
        monkeypatch.setattr(type(ledger), "not_ready_reason", property(lambda self: "disk full"), raising=False)
        replay = c.post("/v1/chat/completions", json=MSG, headers={"idempotency-key": "paid"})
        assert replay.status_code == 200, replay.text
        assert replay.headers["x-tiergate-idempotent-replay"] == "true" and replay.json() == first.json()
        for headers in ({"idempotency-key": "new"}, {}):  # a new key, or none: no claim, no upstream call
            r = c.post("/v1/chat/completions", json=MSG, headers=headers)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
        other = c.post("/v1/chat/completions", json={**MSG, "user": "u"}, headers={"idempotency-key": "paid"})
        assert other.status_code == 503  # the key with another body: nothing stored for it, refused as new work
    assert len(gateway.stub.requests) == 1 and len(gateway.ledger_rows()) == 1
