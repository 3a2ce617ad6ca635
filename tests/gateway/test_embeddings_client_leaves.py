"""An embeddings client that leaves stops its work: the batches still to come for it never run (the one thread that
embeds works for the tenants still waiting), and its one ledger row is `cancelled`, 499, billed for the texts whose
vectors were ready when it left (nothing, if none was). Its Idempotency-Key is given up: a retry runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.embeddings_service import EmbeddingsService
from tests.conftest import Gateway
from tests.gateway.embeddings_leaving import send_and_leave

MODEL = "all-MiniLM-L6-v2"
TEXTS = [f"sentence number {i} about rivers, mountains and the sea" for i in range(24)]  # six passes of four


class Passes:
    """The gateway's forward passes, recorded; from the `hold_at`th on, each waits until `release` is set."""

    def __init__(self, svc: EmbeddingsService, hold_at: int) -> None:
        self.real = svc.batcher.encode_many
        self.hold_at = hold_at
        self.begun: list[list[str]] = []
        self.release = threading.Event()
        svc.batcher.encode_many = self

    def __call__(self, texts: list[str]) -> Any:
        self.begun.append(list(texts))
        if len(self.begun) >= self.hold_at:
            self.release.wait(60)
        return self.real(texts)


@pytest.fixture
def svc(gateway: Gateway) -> EmbeddingsService:
    """The gateway's embeddings service (built by a first request: the first ledger row), passes of four texts."""
    with gateway.client(gateway.tenant_key) as c:
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"}).status_code == 200
    service: EmbeddingsService = gateway.app.state.embeddings
    service.batcher.max_batch = 4
    return service


@pytest.fixture(params=[3, 1], ids=["after-two-passes", "before-any-vector"])
def passes(request: pytest.FixtureRequest, svc: EmbeddingsService) -> Iterator[Passes]:
    p = Passes(svc, request.param)
    yield p
    p.release.set()


def cancelled_row(gw: Gateway, timeout_s: float = 20) -> Any:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        rows = [r for r in gw.ledger_rows() if r.status != "ok"]
        if rows:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"no row for the request whose client left: {gw.ledger_rows()}")


def test_a_client_that_leaves_stops_its_work_and_is_billed_for_what_ran(
        gateway: Gateway, svc: EmbeddingsService, passes: Passes) -> None:
    body = {"model": MODEL, "input": TEXTS}
    send_and_leave(gateway, body, {"Idempotency-Key": "leave-1"}, lambda: len(passes.begun) >= passes.hold_at,
                   "the held pass")
    (row,) = cancelled_row(gateway)  # written while the pass that was running when it left is still held
    ran = [t for texts in passes.begun[:-1] for t in texts]  # the passes that ended before it left
    assert len(ran) == 4 * (passes.hold_at - 1)
    assert (row.tier, row.status, row.http_status) == ("embeddings", "cancelled", 499)
    assert row.input_tokens == sum(svc._num_tokens(ran))
    assert row.price_usd == svc.spec.price(row.input_tokens) and row.output_tokens == 0
    assert (row.cost_basis == "wall") == bool(ran)

    passes.release.set()
    time.sleep(1.0)
    assert len(passes.begun) == passes.hold_at  # the passes still to come for it never ran

    # the key was given up with it: a retry runs (and is answered and billed in full), then replays
    with gateway.client(gateway.tenant_key) as c:
        retry = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "leave-1"})
        again = c.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "leave-1"})
    assert retry.status_code == 200 and "x-tiergate-idempotent-replay" not in retry.headers
    assert len(retry.json()["data"]) == len(TEXTS) and again.headers["x-tiergate-idempotent-replay"] == "true"
    rows = gateway.ledger_rows()
    assert sorted(r.status for r in rows) == ["cancelled", "ok", "ok"]  # the warm-up, the leaver, the retry
    full = sum(svc._num_tokens(TEXTS))
    assert retry.json()["usage"]["prompt_tokens"] == full and [r for r in rows if r.input_tokens == full]
