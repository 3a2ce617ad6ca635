"""A remote tier is shared by every tenant (one upstream account, one prefix cache), so it never gets a tenant's
names for its users and caches as the tenant wrote them: `user`, `safety_identifier` and `prompt_cache_key` arrive
as a keyed hash of (tenant, value), the same for one tenant and apart across tenants, and a vLLM gets the tenant's
prefix-cache namespace as `cache_salt`. Through a real gateway in front of a stub that records the bodies it gets."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.sequence import salt_tenant
from gateway.pipeline.tier_call import cache_salt, forwarded, hint_key, tenant_salt
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState, openai_tiers, write_settings
from tiers.catalogue import TierSpec

HINTS = {"user": "alice@example.com", "safety_identifier": "alice@example.com", "prompt_cache_key": "shared-doc"}
PLANS = """
default_plan: hinted
plans:
  hinted:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    cache: {enabled: false}
"""


@pytest.fixture
def gateway(tmp_path: Path, stub: tuple[ServerThread, StubState], prepared_models: Path) -> Iterator[Gateway]:
    """`small` and `mid` vLLMs (`dialect: vllm-priority`, `vllm`), `full` a strict OpenAI-compatible server; all the
    stub."""
    dialects = {"small": "vllm-priority", "mid": "vllm", "full": "openai"}
    tiers = openai_tiers({name: {"dialect": dialect} for name, dialect in dialects.items()}, url=stub[0].url)
    with running_gateway(write_settings(tmp_path, prepared_models, tiers, PLANS), stub[1], plan="hinted") as gw:
        yield gw


def send(gw: Gateway, key: str, model: str, **extra: Any) -> dict[str, Any]:
    """The body the tier got for one request of `key`'s tenant."""
    with gw.client(key) as c:
        r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, **HINTS, **extra,
                                                 "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    return gw.stub.requests[-1]


def test_a_remote_tier_gets_each_tenants_hints_hashed_apart(gateway: Gateway) -> None:
    gateway.store.create_tenant("globex", "hinted")
    _, other = gateway.store.issue_key("globex", name="test")
    acme = [send(gateway, gateway.tenant_key, "mid"), send(gateway, gateway.tenant_key, "mid")]
    globex = send(gateway, other, "mid")
    # globex names acme's cache key and end user: it gets neither acme's cache nor acme's user's upstream record
    for field, value in HINTS.items():
        assert value not in str(acme) and value not in str(globex)  # the tenant's own value never leaves
        assert acme[0][field] == acme[1][field] != globex[field]  # stable for a tenant, apart across tenants
        assert len(acme[0][field]) == 32  # within OpenAI's 64 characters for safety_identifier
    assert acme[0]["user"] == acme[0]["safety_identifier"]  # one person named twice stays one person
    # vLLM keeps the prefix cache apart by `cache_salt`: one per tenant, not the tenant's name
    assert acme[0]["cache_salt"] == acme[1]["cache_salt"] != globex["cache_salt"]
    assert "acme" not in acme[0]["cache_salt"]
    strict = send(gateway, gateway.tenant_key, "full")  # a strict server gets OpenAI's fields only: no cache_salt
    assert "cache_salt" not in strict and strict["user"] == acme[0]["user"]
    assert send(gateway, gateway.tenant_key, "small")["cache_salt"] == acme[0]["cache_salt"]  # vllm-priority too
    with gateway.client(gateway.tenant_key) as c:  # a text completion's body too
        text = c.post("/v1/completions",
                      json={"model": "mid", "prompt": "hello", "max_tokens": 2, "user": HINTS["user"]})
    assert text.status_code == 200 and gateway.stub.requests[-1]["user"] == acme[0]["user"]
    assert gateway.stub.requests[-1]["cache_salt"] == acme[0]["cache_salt"]


PRICES = {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002", "hardware_cost_per_hour": "0.1",
          "context_limit": 2048}


def test_local_tiers_keep_the_body_and_our_own_calls_carry_no_hints() -> None:
    local = TierSpec(name="mid", backend="local", model="smollm2-135m-instruct", **PRICES)
    vllm = TierSpec(name="mid", backend="openai", model="m", urls=["http://x"], dialect="vllm", **PRICES)
    body = {"model": "mid", "messages": [], **HINTS}
    assert forwarded(body, local, "acme", hint_key("s")) is body  # our engine: the tenant's salt as a header only
    shadow = forwarded(body, vllm, None, hint_key("s"))  # no tenant: no hints, no salt (off-path copies carry theirs)
    assert not set(HINTS) & set(shadow) and "cache_salt" not in shadow
    # the gateway's secret keys the hash: the same on every replica gives the same hashes
    assert forwarded(body, vllm, "acme", hint_key("s"))["user"] == forwarded(body, vllm, "acme", hint_key("s"))["user"]
    assert forwarded(body, vllm, "acme", hint_key("s"))["user"] != forwarded(body, vllm, "acme", hint_key("t"))["user"]


ISOLATING = PLANS + """
  isolating:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    cache: {isolate_users: true}
"""


def test_a_plan_isolating_its_end_users_salts_each_ones_prefixes_apart(
        tmp_path: Path, stub: tuple[ServerThread, StubState], prepared_models: Path) -> None:
    """A prefix cached for one end user made another's time to first token shorter: under `isolate_users` each end
    user (as the cache scope names them) gets a namespace of its own within the tenant's; other plans keep one."""
    dialects = {"small": "vllm-priority", "mid": "vllm", "full": "openai"}
    tiers = openai_tiers({name: {"dialect": dialect} for name, dialect in dialects.items()}, url=stub[0].url)
    with running_gateway(write_settings(tmp_path, prepared_models, tiers, ISOLATING), stub[1], plan="hinted") as gw:
        gw.store.create_tenant("clinic", "isolating")
        _, clinic = gw.store.issue_key("clinic", name="test")

        def salt(key: str, **who: str) -> str:
            with gw.client(key) as c:
                r = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": 2, **who,
                                                         "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200, r.text
            return gw.stub.requests[-1]["cache_salt"]

        alice, bob = salt(clinic, user="alice"), salt(clinic, user="bob")
        nobody = salt(clinic)
        assert alice == salt(clinic, user="alice") and len({alice, bob, nobody}) == 3
        assert salt(clinic, safety_identifier="alice") not in (alice, bob, nobody)  # as the scope tells them apart
        assert alice.split(".")[0] == bob.split(".")[0] == nobody  # one tenant: our engine's share (salt_tenant)
        assert len(alice) <= 64 and "alice" not in alice
        shared = salt(gw.tenant_key, user="alice")  # a plan sharing among its end users: one namespace
        assert shared == salt(gw.tenant_key, user="bob") == salt(gw.tenant_key) and "." not in shared


def test_our_engine_gets_an_isolated_end_users_salt_as_a_header_in_its_tenants_share() -> None:
    local = TierSpec(name="mid", backend="local", model="smollm2-135m-instruct", **PRICES)
    alice = cache_salt(local, "clinic", "user=alice", hint_key("s"))
    assert alice is not None and re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", alice)  # what the engine accepts
    assert alice != cache_salt(local, "clinic", "user=bob", hint_key("s"))
    assert alice != cache_salt(local, "clinic", "user=alice", hint_key("t"))  # keyed: a guess cannot be checked
    assert salt_tenant(alice) == cache_salt(local, "clinic") == tenant_salt("clinic")
