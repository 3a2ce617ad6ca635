"""A tenant's refusal for a model it may not use names only what its plan offers (what /v1/models shows it), and
is the same answer for a name that is no tier and for a tier its plan leaves out (OpenAI's 404 `model_not_found`
for both: "does not exist or you do not have access to it"): neither that 404, nor its headers, nor the 400 of a
request with tools, tells the tenant the names of tiers (and so the models and versions) that its plan does not
offer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState, openai_tiers, stub_app, write_settings

# `full` is in the catalogue but not in the tenant's plan; it cannot call tools (as `small` cannot)
PLANS = """
default_plan: lite
plans:
  lite:
    allowed_tiers: [small, mid]
    default_tier: mid
"""
HIDDEN = "full"
OFFERED = ["auto", "small", "mid"]
MSG = [{"role": "user", "content": "hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def gateway(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    state = StubState()
    with ServerThread(stub_app(state)).start() as upstream:
        tiers = openai_tiers({"small": {"tools": False}, "mid": {}, "full": {"tools": False}}, url=upstream.url)
        settings = write_settings(tmp_path, prepared_models, tiers, PLANS)
        with running_gateway(settings, state, plan="lite") as gw:
            yield gw


def offered(gateway: Gateway) -> list[str]:
    """The chat models /v1/models shows the tenant (the embedding model aside)."""
    with gateway.client(gateway.tenant_key) as c:
        r = c.get("/v1/models")
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"] if "chat.completions" in m["capabilities"]]


def refusal(gateway: Gateway, path: str, body: dict) -> tuple[int, dict]:
    r = answer(gateway, path, body)
    return r.status_code, r.json()["error"]


def answer(gateway: Gateway, path: str, body: dict) -> httpx.Response:
    with gateway.client(gateway.tenant_key) as c:
        return c.post(path, json=body)


def test_the_plan_offers_what_models_shows(gateway: Gateway) -> None:
    assert offered(gateway) == OFFERED  # the premise: `full` exists, but this tenant does not see it


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSG}),
    ("/v1/completions", {"prompt": "hello"}),
])
def test_an_unknown_model_lists_only_the_plans_models(gateway: Gateway, path: str, body: dict) -> None:
    status, err = refusal(gateway, path, {"model": "gpt-9", **body})
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model", err
    assert HIDDEN not in err["message"], err["message"]
    assert err["message"].endswith(": " + ", ".join(offered(gateway))), err["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSG}),
    ("/v1/completions", {"prompt": "hello"}),
])
def test_a_tier_the_plan_leaves_out_reads_like_an_unknown_model(gateway: Gateway, path: str, body: dict) -> None:
    unknown = answer(gateway, path, {"model": "gpt-9", **body})
    hidden = answer(gateway, path, {"model": HIDDEN, **body})
    err = hidden.json()["error"]
    # the same answer as for a name that is no tier: status, code, type, param, words and headers; nothing says
    # `full` is one
    assert hidden.status_code == unknown.status_code == 404, hidden.text
    assert {**err, "message": None} == {**unknown.json()["error"], "message": None}, (err, unknown.text)
    assert err["message"] == unknown.json()["error"]["message"].replace("'gpt-9'", f"'{HIDDEN}'"), (err, unknown.text)
    assert err["message"].count(HIDDEN) == 1  # only where it echoes the request
    assert "does not exist or you do not have access to it" in err["message"]  # OpenAI's words for both
    same = {"x-tiergate-request-id", "date", "content-length"}  # what differs between any two answers
    assert {k: v for k, v in hidden.headers.items() if k not in same} == \
        {k: v for k, v in unknown.headers.items() if k not in same}


def test_a_request_with_tools_does_not_confirm_a_hidden_tier(gateway: Gateway) -> None:
    _, unknown = refusal(gateway, "/v1/chat/completions", {"model": "gpt-9", "messages": MSG})
    status, err = refusal(gateway, "/v1/chat/completions", {"model": HIDDEN, "messages": MSG, "tools": [TOOL]})
    # not "tier 'full' cannot call tools" (a 400 that says it is a tier): the plan's refusal, as without tools
    assert status == 404 and err["code"] == "model_not_found", err
    assert err["message"] == unknown["message"].replace("'gpt-9'", f"'{HIDDEN}'"), (err, unknown)
    # a tier the plan offers that cannot call tools is still refused by name, naming `tools`
    status, err = refusal(gateway, "/v1/chat/completions", {"model": "small", "messages": MSG, "tools": [TOOL]})
    assert status == 400 and err["param"] == "tools" and "'small'" in err["message"], err
    assert gateway.ledger_rows() == []
