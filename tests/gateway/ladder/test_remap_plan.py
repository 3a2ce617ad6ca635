"""A ladder's remap through the HTTP API, bounded by the tenant's plan: a level that moves `full` to `mid` never serves
(or bills) `mid` to a tenant whose plan leaves it out, nor a dearer tier to one that did not agree to pay for it; it
takes the closest cheaper tier the plan allows, else refuses with a 503 naming the level. A remap to a tier the
tiers file does not have is refused when the ladder file is read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState, openai_tiers, stub_app, write_settings

PLANS = """
default_plan: gapped
plans:
  gapped:                       # no `mid`: a remap full -> mid must not reach it
    allowed_tiers: [small, full]
    default_tier: full
  fullonly:
    allowed_tiers: [full]
    default_tier: full
  everything:                   # every tier, but no consent to pay for a dearer one
    allowed_tiers: [small, mid, full]
    default_tier: small
  upgrading:
    allowed_tiers: [small, mid, full]
    default_tier: small
    allow_upgrade: true
"""
LADDER = """
levels:
  - {level: 0, name: normal}
  - {level: 1, name: conserve, actions: [{remap_tiers: {full: mid}}]}
  - {level: 2, name: upgrade, actions: [{remap_tiers: {small: mid}}]}
"""
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def gateway(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    state = StubState()
    with ServerThread(stub_app(state)).start() as upstream:
        tiers = openai_tiers({"small": {"price_per_1k_input": "0.0001", "price_per_1k_output": "0.0002"},
                              "mid": {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002"},
                              "full": {"price_per_1k_input": "0.003", "price_per_1k_output": "0.006"}},
                             url=upstream.url)
        (tmp_path / "ladder.yaml").write_text(LADDER)
        settings = write_settings(tmp_path, prepared_models, tiers, PLANS, ladder_file=tmp_path / "ladder.yaml",
                                  ladder_tick_s=0.05)
        with running_gateway(settings, state, plan="gapped") as gw:
            yield gw


def set_level(gw: Gateway, level: int) -> None:
    with gw.client(gw.admin_key) as c:
        r = c.post("/admin/degrade/", json={"level": level, "reason": "test"})
    assert r.status_code == 200, r.text


def key_on(gw: Gateway, plan: str) -> str:
    gw.store.create_tenant(plan, plan)
    return gw.store.issue_key(plan)[1]


def chat(gw: Gateway, model: str, key: str | None = None) -> httpx.Response:
    with gw.client(key or gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": model, "messages": MSG})


@pytest.mark.parametrize("model", ["full", "auto"])  # `auto` is the plan's default, `full`
def test_a_remap_to_a_tier_outside_the_plan_takes_the_closest_cheaper_one_it_allows(gateway: Gateway,
                                                                                  model: str) -> None:
    set_level(gateway, 1)
    r = chat(gateway, model)
    assert r.status_code == 200, r.text
    assert r.headers["x-tiergate-tier"] == "small" and r.json()["model"] == "small"
    assert r.headers["x-tiergate-degrade-actions"] == "remap_tiers(full->small)"
    assert "mid" not in r.headers["x-tiergate-route-reason"]  # the tenant does not learn of a tier it cannot use
    (row,) = gateway.ledger_rows()
    assert (row.tier, row.degrade_level, row.degrade_actions) == ("small", 1, "remap_tiers(full->small)")


def test_a_plan_with_no_tier_in_the_remapped_ones_place_is_refused_naming_the_level(gateway: Gateway) -> None:
    key = key_on(gateway, "fullonly")
    set_level(gateway, 1)
    for model in ("full", "auto"):
        r = chat(gateway, model, key)
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "degraded_no_tier" and err["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "30" and "level 1" in err["message"] and "'full'" in err["message"]
        assert "mid" not in err["message"] and "mid" not in r.headers["x-tiergate-degrade-actions"]
    assert gateway.ledger_rows() == []  # nothing served, nothing billed
    set_level(gateway, 0)
    assert chat(gateway, "full", key).headers["x-tiergate-tier"] == "full"


def test_a_remap_to_a_dearer_tier_needs_the_plans_consent_to_pay_for_it(gateway: Gateway) -> None:
    set_level(gateway, 2)  # small -> mid: mid bills ten times small's price
    r = chat(gateway, "small", key_on(gateway, "everything"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "degraded_no_tier", r.text
    assert gateway.ledger_rows() == []
    r = chat(gateway, "small", key_on(gateway, "upgrading"))  # allow_upgrade: the tenant pays for a dearer tier
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid", r.text
    assert r.headers["x-tiergate-degrade-actions"] == "remap_tiers(small->mid)"


def test_a_remap_the_plan_allows_is_unchanged(gateway: Gateway) -> None:
    set_level(gateway, 1)
    r = chat(gateway, "full", key_on(gateway, "everything"))
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid", r.text
    assert r.headers["x-tiergate-degrade-actions"] == "remap_tiers(full->mid)"


def test_reload_names_a_remaps_unknown_tier_and_refuses_a_tier_mapped_to_itself(gateway: Gateway) -> None:
    f, key = gateway.settings.ladder_file, key_on(gateway, "everything")
    with gateway.client(gateway.admin_key) as c:
        f.write_text(LADDER.replace("{full: mid}", "{full: full}"))
        r = c.post("/admin/degrade/reload")
        assert r.status_code == 400 and "maps 'full' to itself" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "invalid_ladder_file" and f"{f}:4" in r.json()["error"]["message"]
        set_level(gateway, 1)  # the running ladder stayed
        assert chat(gateway, "full", key).headers["x-tiergate-tier"] == "mid"
        # a misspelt target loads (a fleet without one of the shipped ladder's tiers must start) and is named
        f.write_text(LADDER.replace("{full: mid}", "{full: mdi}"))
        r = c.post("/admin/degrade/reload")
        assert r.status_code == 200 and r.json()["unknown_tiers"] == ["mdi"], r.text
    # the remap passes the unknown target over for the closest cheaper tier the plan allows
    r = chat(gateway, "full", key)
    assert r.headers["x-tiergate-tier"] == "mid" and r.headers["x-tiergate-degrade-actions"] == "remap_tiers(full->mid)"
