"""A JSON cascade whose retry's ledger row is withdrawn (queued past the ledger's wait: gateway/pipeline/settle.py):
the first answer's row is durable already (it settled before the retry ran), the retry is billed nothing, so the
first answer stands and is the client's, its cascade header saying why, as when the retry fails. Before, the client
was told 503 `ledger_unavailable` ("retry later") while billed for the first answer it never got."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cascade_logprobs import engine_small, settings  # noqa: F401 (fixtures)
from tests.gateway.test_idempotency_ledger_late import StuckWriter, wait_until
from tests.gateway.test_routing_api import chat, with_difficulty_model
from tests.gateway.test_settle_late_row import spent_pico
from tests.stubs import StubState


def stuck_before_the_retry(gw: Gateway) -> StuckWriter:
    """The ledger's writer held (a slow disk) from the moment the retry's row is queued: that row stays queued past
    the wait and is withdrawn; the first attempt's row was written before."""
    stuck = StuckWriter.__new__(StuckWriter)
    ledger = gw.app.state.services.pipeline.settler.ledger
    real = ledger.submit

    def submit(row: Any, **kwargs: Any) -> Any:
        if row.cascade_of is not None:
            StuckWriter.__init__(stuck, gw)
            stuck.__enter__()
        return real(row, **kwargs)

    ledger.submit = submit
    return stuck


def test_a_retry_whose_row_is_withdrawn_leaves_the_first_answer_standing(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with running_gateway(settings[0], settings[1], plan="unsure") as gw:
        with_difficulty_model(gw, tmp_path)
        backend = gw.app.state.services.quota_backend
        assert isinstance(backend, MemoryBackend)
        before = spent_pico(backend)
        stuck = stuck_before_the_retry(gw)
        try:
            r = chat(gw, "easy")  # the fake difficulty model sends "easy" to small, whose answer is unsure
        finally:
            stuck.__exit__()
        assert len(settings[1].requests) == 1  # the retry ran on mid
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-cascade"] == "small->mid failed (ledger_unavailable)"
        assert r.json()["choices"][0]["message"]["content"] == "unsure."  # the first answer, the one billed
        wait_until(lambda: not backend._held)
        rows = gw.ledger_rows()
        assert [row.tier for row in rows] == ["small"], rows  # the retry's row never commits
        assert rows[0].request_id == r.headers["x-tiergate-request-id"]
        assert spent_pico(backend) - before == int(rows[0].price_usd * 10**12)  # the first answer's, once
