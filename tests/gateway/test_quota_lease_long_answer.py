"""An answer that runs longer than its reservation's lease (`TIERGATE_QUOTA_LEASE_S`; nothing bounds a whole answer's
time) keeps its money reserved until it settles: the gateway renews the lease of its requests still running at each
reaper round. Before, the reaper returned the reservation mid-answer as a dead replica's (refunded, its slot freed),
and a tenant whose budget held one answer's upper bound was let start a second meanwhile."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.settings import Settings
from quotas.backends.memory import MemoryBackend
from quotas.money import to_pico
from tests.conftest import Gateway, running_gateway, tiers_yaml
from tests.stubs import ServerThread, StubState, free_port, stub_app

LEASE_S = 0.5
WORDS = 20  # the upstream's answer, a word every 0.2 s ("STUB:slow"): 4 s, eight leases
PLANS = """
default_plan: long
plans:
  long:
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {budget_day_usd: "0.003"}  # one answer's upper bound (1,000 output tokens at mid's price), not two
"""


@pytest.fixture
def gw(gateway_settings: Settings, tmp_path: Path) -> Iterator[Gateway]:
    state = StubState()
    server = ServerThread(stub_app(state, reply=" ".join(["word"] * WORDS))).start()
    (tmp_path / "long-tiers.yaml").write_text(tiers_yaml(server.url, f"http://127.0.0.1:{free_port()}"))
    (tmp_path / "long-plans.yaml").write_text(PLANS)
    settings = gateway_settings.model_copy(update={
        "tiers_file": tmp_path / "long-tiers.yaml", "plans_file": tmp_path / "long-plans.yaml",
        "quota_lease_s": LEASE_S, "quota_reap_every_s": 0.05})
    try:
        with running_gateway(settings, state, plan="long") as gateway:
            yield gateway
    finally:
        server.stop()


def body(content: str, stream: bool) -> dict[str, object]:
    return {"model": "mid", "messages": [{"role": "user", "content": content}], "max_tokens": 1000, "stream": stream}


def test_an_answer_longer_than_its_lease_keeps_its_money_reserved(gw: Gateway) -> None:
    backend = gw.app.state.services.quota_backend
    assert isinstance(backend, MemoryBackend)
    with gw.client(gw.tenant_key) as first, gw.client(gw.tenant_key) as second:
        with first.stream("POST", "/v1/chat/completions", json=body("STUB:slow a long story", True)) as long:
            assert long.status_code == 200
            lines = long.iter_lines()
            next(lines)  # it has begun
            time.sleep(3 * LEASE_S)  # it runs on, past its lease
            rid = long.headers["x-tiergate-request-id"]
            assert rid in backend._held and not backend._reaped  # still reserved, never reaped
            other = second.post("/v1/chat/completions", json=body("hello", False))
            assert other.status_code == 429, other.text  # the budget holds the long answer's upper bound
            assert other.json()["error"]["code"] == "insufficient_quota"
            rest = "\n".join(lines)
        assert "[DONE]" in rest
        assert second.post("/v1/chat/completions", json=body("hello", False)).status_code == 200  # settled: room
    day = time.strftime("%Y%m%d", time.gmtime())
    rows = gw.ledger_rows()
    assert [r.status for r in rows] == ["ok", "ok"]
    assert backend.spend_of("acme", "t", day, day[:6])[0] == to_pico(sum((r.price_usd for r in rows), Decimal(0)))
