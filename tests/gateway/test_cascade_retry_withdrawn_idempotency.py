"""A JSON cascade under an Idempotency-Key whose retry's ledger row is withdrawn (queued past the ledger's wait): the
first answer stands and is the client's (tests/gateway/test_cascade_retry_withdrawn.py), so it is the key's answer
too: stored under the key, and the SDK's retry with the key gets it replayed, charged nothing. Before, the retry's
withdrawn row gave the key's claim up, the first answer was never stored, and the retry with the key ran the request
again and was billed again. On each records' store: SQLite (embedded), Redis (replicas), PostgreSQL (a fleet)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from tests.conftest import running_gateway
from tests.gateway.test_cascade_logprobs import engine_small, settings  # noqa: F401 (fixtures)
from tests.gateway.test_cascade_retry_withdrawn import stuck_before_the_retry
from tests.gateway.test_idempotency_ledger_late import wait_until
from tests.gateway.test_routing_api import with_difficulty_model
from tests.gateway.test_settle_late_row import spent_pico
from tests.stubs import StubState

BODY = {"model": "auto", "messages": [{"role": "user", "content": "easy"}]}  # small answers "unsure.", mid retries it
REPLAY = "x-tiergate-idempotent-replay"


@pytest.mark.parametrize("records", ["sqlite", "redis", "postgres"])
def test_the_first_answer_standing_for_a_withdrawn_retry_is_the_keys_and_replayed(
        settings: tuple[Settings, StubState], tmp_path: Path, records: str,  # noqa: F811
        request: pytest.FixtureRequest) -> None:
    update = ({"redis_url": request.getfixturevalue("redis_url")} if records == "redis" else
              {"database_url": request.getfixturevalue("database_url")} if records == "postgres" else {})
    with running_gateway(settings[0].model_copy(update=update), settings[1], plan="unsure") as gw:
        with_difficulty_model(gw, tmp_path)
        backend = gw.app.state.services.quota_backend
        before = spent_pico(backend) if isinstance(backend, MemoryBackend) else None
        stuck = stuck_before_the_retry(gw)
        try:
            with gw.client(gw.tenant_key) as c:
                first = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-11"})
        finally:
            stuck.__exit__()
        assert first.status_code == 200, first.text
        assert first.headers["x-tiergate-cascade"] == "small->mid failed (ledger_unavailable)"
        assert first.json()["choices"][0]["message"]["content"] == "unsure."
        assert len(settings[1].requests) == 1  # the retry ran on mid; its row never commits
        with gw.client(gw.tenant_key) as c:  # the SDK's retry with the key, the first answer lost on the way
            again = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-11"})
        assert again.status_code == 200, again.text
        assert again.headers.get(REPLAY) == "true", again.headers  # not run again
        assert again.json()["id"] == first.json()["id"]
        assert again.json()["choices"] == first.json()["choices"] and again.json()["usage"] == first.json()["usage"]
        assert len(settings[1].requests) == 1  # mid asked once in all
        rows = gw.ledger_rows()
        assert [(row.tier, row.request_id) for row in rows] == [("small", first.headers["x-tiergate-request-id"])]
        if isinstance(backend, MemoryBackend):  # billed once: the first answer's row alone
            assert before is not None
            wait_until(lambda: not backend._held)
            assert spent_pico(backend) - before == int(rows[0].price_usd * 10**12)
