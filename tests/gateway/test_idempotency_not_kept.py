"""An answer over the store's bound for one answer (4 MiB: a long answer with top log-probabilities passes it) is
answered but not stored; its key is still kept as answered, so the SDK's retry with it is told so (409
`idempotency_answer_not_kept`, no Retry-After: waiting does not help) and is neither run nor billed again. Before, its
claim was given up and the retry ran and was billed a second time: one key, two runs. The records in SQLite and in
PostgreSQL here; the stores' own tests have Redis too (tests/quotas/test_idempotency_store.py)."""

from __future__ import annotations

import pytest

from gateway.settings import Settings
from quotas.idempotency import Limits
from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture(params=["sqlite", "postgres"])
def gateway_settings(request: pytest.FixtureRequest, gateway_settings: Settings) -> Settings:
    if request.param == "sqlite":
        return gateway_settings
    return gateway_settings.model_copy(update={"database_url": request.getfixturevalue("database_url")})


def test_a_retry_of_an_answer_too_large_to_keep_is_told_so_and_not_run_again(gateway: Gateway) -> None:
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
