"""The cascade's check reads the router artifact (PredictorSource.calibration: a changed artifact is loaded in a
thread) after the first attempt is reserved and before the pipeline's `answer`, whose finally settles it, starts.
From `reserve` on an attempt settles exactly once: a client that leaves while the artifact loads frees its slot and
reservation (a cancelled row, nothing billed), and a loader that fails (with a KeyError, not only a bad file's
ValueError) keeps the old artifact and fails no request."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_routing_api import tiers_yaml
from tests.stubs import ServerThread, StubState
from tiers.predictor import PredictorSource

PLANS = """
default_plan: single
plans:
  single:
    allowed_tiers: [small, mid, full]
    default_tier: small
    routing: {quality_floor: 0.8, policy: cascade}
    limits: {max_concurrent: 1, budget_day_usd: "1"}
"""

BODY = {"model": "auto", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def settings(gateway_settings: Settings, stub: tuple[ServerThread, StubState], tmp_path: Path) -> Settings:
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(stub[0].url, [stub[0].url], stub[0].url))
    (tmp_path / "plans.yaml").write_text(PLANS)
    return gateway_settings


def with_loader(gw: Gateway, tmp_path: Path, loader: Callable[[Path], Any]) -> PredictorSource:
    """A router artifact that has just appeared (`router train` finished): the next check loads it."""
    artifact = tmp_path / "difficulty.json"
    artifact.write_text("{}")
    source = PredictorSource(artifact, loader)
    gw.app.state.services.pipeline.route.predictor = source
    return source


def held(gw: Gateway) -> list[str]:
    return list(gw.app.state.services.quota_backend._held)


def wait_settled(gw: Gateway, rows: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (held(gw) or len(gw.ledger_rows()) < rows):
        time.sleep(0.05)


def post(gw: Gateway, timeout: float = 30) -> httpx.Response:
    with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {gw.tenant_key}"}, timeout=timeout) as c:
        return c.post("/v1/chat/completions", json=BODY)


def test_a_client_that_leaves_while_the_artifact_loads_holds_nothing(settings: Settings,
                                                                     stub: tuple[ServerThread, StubState],
                                                                     tmp_path: Path) -> None:
    def slow(_: Path) -> Any:
        time.sleep(1.5)  # a freshly trained artifact's load
        raise ValueError("not a real artifact")

    with running_gateway(settings, stub[1], plan="single") as gw:
        with_loader(gw, tmp_path, slow)
        with pytest.raises(httpx.ReadTimeout):
            post(gw, timeout=0.4)  # the client leaves during the load
        time.sleep(1.5)  # the load ends
        wait_settled(gw, 1)
        assert held(gw) == []  # the slot and reserved money are free now, not at the lease's end
        (row,) = gw.ledger_rows()
        assert (row.status, row.http_status, row.price_usd, row.tier) == ("cancelled", 499, 0, "small")
        assert not stub[1].requests  # nothing ran
        r = post(gw)  # max_concurrent 1: the tenant's next request is admitted
        assert r.status_code == 200, r.text
        wait_settled(gw, 2)
        assert held(gw) == []


def test_a_loader_that_raises_keyerror_keeps_the_old_artifact_and_fails_nothing(
        settings: Settings, stub: tuple[ServerThread, StubState], tmp_path: Path) -> None:
    def broken(_: Path) -> Any:
        raise KeyError("heads")  # a malformed artifact that is not a ValueError

    with running_gateway(settings, stub[1], plan="single") as gw:
        source = with_loader(gw, tmp_path, broken)
        r = post(gw)
        assert r.status_code == 200, r.text
        assert source.model is None and source.error is not None and "KeyError" in source.error
        wait_settled(gw, 1)
        assert held(gw) == []
        assert [row.status for row in gw.ledger_rows()] == ["ok"]
        r = post(gw)
        assert r.status_code == 200, r.text
        wait_settled(gw, 2)
        assert held(gw) == [] and len(gw.ledger_rows()) == 2
