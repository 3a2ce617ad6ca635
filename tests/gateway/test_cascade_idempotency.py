"""A cascade under an Idempotency-Key: the answer the client got is the one its key keeps. When the dearer tier's retry
fails, the first answer stands (answered 200, billed with the retry's refusal); the SDK's retry with the key, that
answer lost on the way, is its replay, charged nothing, not a second run billed again (it ran again: the first answer
was not kept, and its claim was given up)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend, _day_month
from quotas.money import to_pico
from tests.conftest import running_gateway
from tests.gateway.test_cascade_logprobs import calibrated, engine_small, settings  # noqa: F401 (fixtures)
from tests.gateway.test_routing_api import with_difficulty_model
from tests.stubs import StubState

BODY = {"model": "auto", "messages": [{"role": "user", "content": "easy STUB:400"}]}  # small answers, mid refuses


@pytest.mark.parametrize("records", ["sqlite", "redis", "postgres"])
def test_a_first_answer_that_stands_when_its_retry_fails_is_replayed_not_run_and_billed_again(
        settings: tuple[Settings, StubState], tmp_path: Path, records: str,  # noqa: F811
        request: pytest.FixtureRequest) -> None:
    """Its records in SQLite (embedded), Redis (replicas) or PostgreSQL (a fleet's database)."""
    update = ({"redis_url": request.getfixturevalue("redis_url")} if records == "redis" else
              {"database_url": request.getfixturevalue("database_url")} if records == "postgres" else {})
    with running_gateway(settings[0].model_copy(update=update), settings[1], plan="unsure") as gw:
        with_difficulty_model(gw, tmp_path)
        with gw.client(gw.tenant_key) as c:
            first = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-7"})
            assert first.status_code == 200, first.text
            assert first.headers["x-tiergate-cascade"].startswith("small->mid failed")
            assert first.json()["choices"][0]["message"]["content"] == "unsure."
            ran = len(gw.ledger_rows())  # the first answer's row and the refused retry's
            again = c.post("/v1/chat/completions", json=BODY, headers={"idempotency-key": "order-7"})
        assert again.status_code == 200, again.text
        assert again.headers.get("x-tiergate-idempotent-replay") == "true"
        assert again.json()["id"] == first.json()["id"]
        assert again.json()["choices"] == first.json()["choices"] and again.json()["usage"] == first.json()["usage"]
        rows = gw.ledger_rows()
        assert len(rows) == ran == 2 and len(settings[1].requests) == 1  # ran once, billed once
        backend = gw.app.state.services.quota_backend
        if not isinstance(backend, MemoryBackend):
            return
        deadline = time.monotonic() + 5
        while backend._held and time.monotonic() < deadline:
            time.sleep(0.05)
        day, month = _day_month(time.time())
        assert backend.spend_of("acme", "t", day, month)[0] == sum(to_pico(r.price_usd) for r in rows)


def test_a_whole_stream_held_for_its_retry_stands_when_the_retry_fails_before_its_first_byte(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    """A streamed answer shorter than the look-ahead is held whole and judged at its end; failing, it is retried on
    the dearer tier. That retry refused before any of it was sent, the held answer is whole and billed: it is sent,
    as a JSON answer's first attempt is (it was a 400, the tenant billed for an answer it never got)."""
    with calibrated(settings, tmp_path, 0.0, lookahead=32, plan="streamed") as gw:
        body = {"model": "auto", "messages": [{"role": "user", "content": "anything STUB:400"}], "max_tokens": 64,
                "stream": True}
        with gw.client(gw.tenant_key) as c, c.stream("POST", "/v1/chat/completions", json=body,
                                                     headers={"idempotency-key": "stream-9"}) as r:
            status, headers = r.status_code, dict(r.headers)
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert status == 200, events
        assert headers["x-tiergate-cascade"].startswith("small->mid failed") and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == "unsure."
        assert len(settings[1].requests) == 1  # the retry was asked, and refused
        with gw.client(gw.tenant_key) as c:  # the SDK's retry with the key: the same answer, not a second run
            again = c.post("/v1/chat/completions", json=body, headers={"idempotency-key": "stream-9"})
        assert again.status_code == 200 and again.headers.get("x-tiergate-idempotent-replay") == "true"
        assert len(settings[1].requests) == 1 and len(gw.ledger_rows()) == 2
