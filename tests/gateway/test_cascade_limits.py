"""A cascaded request is one client request under its plan's limits: its retry on the dearer tier takes over the
first attempt's concurrency slot and takes no second place in the requests-per-minute window (under
`max_concurrent: 1` every escalation was refused, and each one counted twice against rpm); both attempts' tokens
and money are billed as before. A retry refused for money leaves the first answer standing and holds nothing. On the
in-process quota store and on Redis."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_routing_api import LADDER, Fleet3, chat, fleet3, tiers_yaml, with_difficulty_model  # noqa: F401

PLANS = """
default_plan: one
plans:
  one:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true}
    limits: {max_concurrent: 1, rpm: 2}
  paced:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true}
    limits: {rpm: 2}
  poor:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    routing: {quality_floor: 0.8, cascade: true}
    limits: {max_concurrent: 1, budget_day_usd: "0.0005"}
"""


@pytest.fixture(params=["memory", "redis"])
def settings(gateway_settings: Settings, fleet3: Fleet3, tmp_path: Path,  # noqa: F811
             request: pytest.FixtureRequest) -> Settings:
    s = fleet3.servers
    (tmp_path / "tiers.yaml").write_text(tiers_yaml(s[0].url, [s[1].url, s[2].url], s[3].url))
    (tmp_path / "plans.yaml").write_text(PLANS)
    (tmp_path / "ladder.yaml").write_text(LADDER)
    update: dict[str, object] = {"ladder_file": tmp_path / "ladder.yaml"}
    if request.param == "redis":
        update["redis_url"] = request.getfixturevalue("redis_url")
    return gateway_settings.model_copy(update=update)


@contextlib.contextmanager
def gateway(settings: Settings, fleet3: Fleet3, tmp_path: Path, plan: str) -> Iterator[Gateway]:  # noqa: F811
    with running_gateway(settings, fleet3.mid0, plan=plan) as gw:
        with_difficulty_model(gw, tmp_path)
        yield gw


def rows(gw: Gateway, n: int) -> list:  # type: ignore[type-arg]
    deadline = time.monotonic() + 10
    while len(out := gw.ledger_rows()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


@pytest.mark.parametrize("plan", ["one", "paced"])  # max_concurrent 1 and rpm 2; rpm 2 alone
def test_a_cascade_under_max_concurrent_1_escalates_and_counts_once_against_rpm(
        settings: Settings, fleet3: Fleet3, tmp_path: Path, plan: str) -> None:  # noqa: F811
    with gateway(settings, fleet3, tmp_path, plan) as gw:
        _escalates_and_counts_once(gw)


def _escalates_and_counts_once(gateway: Gateway) -> None:
    for _ in range(2):  # rpm 2: two client requests, each answered twice
        r = chat(gateway, "easy")
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-cascade"] == "small->mid", r.headers.get("x-tiergate-route-reason")
        assert r.headers["x-tiergate-tier"] == "mid"
    billed = rows(gateway, 4)
    assert sorted(row.tier for row in billed) == ["mid", "mid", "small", "small"]  # both attempts billed, as before
    assert all(row.status == "ok" for row in billed)
    r = chat(gateway, "easy")  # a third client request is over rpm 2
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_rpm"


def test_a_retry_refused_for_money_leaves_the_first_answer_and_holds_nothing(
        settings: Settings, fleet3: Fleet3, tmp_path: Path) -> None:  # noqa: F811
    with gateway(settings, fleet3, tmp_path, "poor") as gw:
        _refused_for_money(gw)


def _refused_for_money(gateway: Gateway) -> None:
    r = chat(gateway, "easy", max_tokens=400)  # small's bound fits the budget, mid's does not
    assert r.status_code == 200, r.text
    assert "x-tiergate-cascade" not in r.headers and r.headers["x-tiergate-tier"] == "small"
    assert "cascade to mid refused (insufficient_quota)" in r.headers["x-tiergate-route-reason"]
    (row,) = rows(gateway, 1)
    assert row.tier == "small" and row.status == "ok"
    r = chat(gateway, "easy", max_tokens=1)  # max_concurrent 1: the slot was freed (once), the next is admitted
    assert r.status_code == 200, r.text
