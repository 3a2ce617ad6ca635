"""Through a gateway: a request whose Idempotency-Key lease could not be renewed before it may end (the records' store
failing all that while) is stopped, settled once as cancelled and billed for what ran, and its client told 503
`idempotency_lease_lost` in OpenAI's shape, as a JSON answer or as a stream's last event. It went on, answered and
was billed while a retry could take the key over and run. The store is the gateway's SQLite one, its renewals made to
fail (tests/gateway/test_idempotency_lease_lost.py has them fail for real)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gateway.embeddings_service import EmbeddingsService
from quotas.ledger import LedgerUnavailable
from tests.conftest import Gateway
from tests.gateway.test_billing_prefill import rows_when
from tests.gateway.test_embeddings_client_leaves import MODEL, TEXTS, Passes, cancelled_row, svc  # noqa: F401

SLOW = {"model": "mid", "messages": [{"role": "user", "content": "STUB:slow"}]}  # six words, 0.2 s apart
LEASE_S = 0.4  # its request is stopped a thirtieth of it before it may end: about two words in


@pytest.fixture
def failing_renewals(gateway: Gateway) -> Gateway:
    stage = gateway.app.state.services.pipeline.idempotency
    stage.lease_s = LEASE_S

    async def renew(*_: Any) -> bool:
        raise LedgerUnavailable("database is locked")

    stage.store.renew = renew
    return gateway


def lease_lost(error: dict[str, Any]) -> None:
    assert error["code"] == "idempotency_lease_lost" and error["param"] == "Idempotency-Key", error
    assert error["type"] == "service_unavailable" and "retry with the same key" in error["message"]


def billed_once_for_what_ran(gateway: Gateway) -> None:
    (row,) = rows_when(gateway, 1)  # settled once (a cancel's row is queued, not waited for)
    assert row.status == "cancelled" and row.http_status == 499
    assert 0 < row.output_tokens < 6 and row.price_usd > 0  # what ran, billed as a cancel is
    deadline = time.monotonic() + 10
    while not gateway.stub.finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway.stub.finished == ["disconnected"]  # the upstream was told to stop


def test_a_stream_whose_lease_is_lost_ends_with_the_error_and_is_billed_for_what_ran(
        failing_renewals: Gateway) -> None:
    gw = failing_renewals
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={**SLOW, "stream": True}, headers={"idempotency-key": "long"})
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events, "the stream ran to its end past its lease"
    lease_lost(json.loads(events[-1])["error"])
    billed_once_for_what_ran(gw)


def test_a_json_answer_whose_lease_is_lost_is_a_503_and_a_retry_runs(failing_renewals: Gateway) -> None:
    gw = failing_renewals
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=SLOW, headers={"idempotency-key": "long"})
        assert r.status_code == 503, r.text
        lease_lost(r.json()["error"])
        assert int(r.headers["retry-after"]) >= 1
        billed_once_for_what_ran(gw)
        del gw.app.state.services.pipeline.idempotency.store.renew  # the store renews again
        retry = c.post("/v1/chat/completions", json=SLOW, headers={"idempotency-key": "long"})
    assert retry.status_code == 200, retry.text  # its claim was given up: the retry runs, and is billed
    assert retry.headers.get("x-tiergate-idempotent-replay") is None and len(gw.ledger_rows()) == 2


def test_an_embeddings_request_whose_lease_is_lost_is_a_503_billed_for_the_vectors_made(
        failing_renewals: Gateway, svc: EmbeddingsService) -> None:  # noqa: F811
    gw = failing_renewals
    passes = Passes(svc, hold_at=3)  # two passes of four texts, then the third held past the lease
    try:
        with gw.client(gw.tenant_key) as c:
            r = c.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}, headers={"idempotency-key": "e"})
        assert r.status_code == 503, r.text
        lease_lost(r.json()["error"])
        (row,) = cancelled_row(gw)  # the warm-up's row is ok: this one settled once
        assert (row.tier, row.status, row.http_status) == ("embeddings", "cancelled", 499)
        assert row.input_tokens == sum(svc._num_tokens(TEXTS[:8]))  # the two passes that ran
    finally:
        passes.release.set()
