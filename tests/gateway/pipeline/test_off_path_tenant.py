"""A call no client waits for (a rollout's shadow copy, a sampled cache hit's check: off_path.py) goes to the tier as
the tenant's request it copies or checks, through the real TierCaller. Before, it went with no tenant: the replica's
breaker took its failures for the gateway's own, which it never holds as one tenant's, so one tenant's prompts that
the candidate chokes on (5 of them, shadowed) opened the candidate's breaker for everyone, and the guard rolled the
rollout back; and the tier got the tenant's prompt without its prefix-cache namespace (`cache_salt`) or its hashed
`user` and `prompt_cache_key`, in the namespace every tenant shares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cache import TenantPolicy
from gateway.metrics import GatewayMetrics
from gateway.pipeline.cache_check import CacheChecks
from gateway.pipeline.tier_call import TierCaller, upstream_body
from gateway.rollout.shadow import Shadow
from quotas.plans import PRIORITY_ORDER
from tiers.catalogue import TierSpec
from tiers.errors import UpstreamRejected
from tiers.replica import Replica
from wire.chat_request import ChatCompletionRequest

PRICES = {"price_per_1k_input": "0.001", "price_per_1k_output": "0.002", "hardware_cost_per_hour": "0.1",
          "context_limit": 2048}
VLLM = TierSpec(name="mid", backend="openai", model="m", urls=["http://b:1"], dialect="vllm", **PRICES)
LOCAL = TierSpec(name="mid", backend="local", model="smollm2-135m-instruct", **PRICES)
HINTS = {"user": "alice", "prompt_cache_key": "shared-doc"}


class _Client:
    """The tier's server: a 500 for a prompt saying CHOKE, else a short answer; it records what it got."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, Any], str | None]] = []  # (body, cache_salt header)

    def stream_chat(self, url: str, body: dict[str, Any], *, api_key: str | None = None, cache_salt: str | None = None,
                    on_sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        self.got.append((body, cache_salt))

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            if "CHOKE" in str(body["messages"]):
                raise UpstreamRejected(500, {"error": {"message": "engine crashed"}})
            yield {"choices": [{"delta": {"content": "hello"}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        return chunks()


class _Fleet:
    """One replica of the tier, its real breaker."""

    def __init__(self) -> None:
        self.replica = Replica(tier="mid", index=0, url="http://b:1", status="ready", healthy=True)

    def pick(self, tier: str, exclude: set[int] | None = None, affinity: str | None = None,
             version: str | None = None, tenant: str = "") -> tuple[Replica, str]:
        self.replica.breaker.begin()
        return self.replica, "the only one"

    def api_key(self, tier: TierSpec) -> None:
        return None

    def served(self, affinity: str | None, replica: Replica, tenant: str = "") -> None:
        pass


class _Rollouts:
    """A shadow copying every request of a tier to the tier itself as the candidate."""

    rollout = SimpleNamespace(tier="mid", candidate="v2")

    def shadow_of(self, tier: TierSpec, request_id: str) -> Any:
        return self.rollout, tier

    def observe_shadow(self, rollout: Any, **kw: Any) -> None:
        pass


def _request(text: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "mid", "messages": [{"role": "user", "content": text}],
                                                 **HINTS})


def _caller() -> tuple[TierCaller, _Fleet, _Client]:
    fleet, client = _Fleet(), _Client()
    return TierCaller(fleet=fleet, client=client, hint_secret="s"), fleet, client  # type: ignore[arg-type]


def _hit() -> Any:
    return SimpleNamespace(shadow_rate=0.5, usage={"completion_tokens": 1, "finish_reason": "stop"})


def _senders(caller: TierCaller, tier: TierSpec = VLLM) -> dict[str, Callable[..., Awaitable[None]]]:
    """Each way a request of `tenant` reaches `tier`: `send(tenant, text, end_user)`, awaited to its end."""
    shadow = Shadow(rollouts=_Rollouts(), caller=caller, metrics=GatewayMetrics())  # type: ignore[arg-type]
    checks = CacheChecks(cache=SimpleNamespace(label=lambda hit, policy, text: True),  # type: ignore[arg-type]
                         caller=caller, registry=CollectorRegistry())

    def isolated(end_user: str | None) -> dict[str, str]:  # (left out where None: the senders as they were take it)
        return {} if end_user is None else {"end_user": end_user}

    async def direct(tenant: str, text: str, end_user: str | None = None) -> None:
        body = upstream_body(_request(text), tier, max_tokens=8, priority=PRIORITY_ORDER["batch"], logprobs=False)
        try:
            async for _ in await caller.open(tier, body, affinity=None, tenant=tenant, end_user=end_user):
                pass
        except UpstreamRejected:
            pass

    async def shadowed(tenant: str, text: str, end_user: str | None = None) -> None:
        shadow.send(tier, "r", _request(text), 8, "hello", tenant=tenant, **isolated(end_user))
        await shadow.tasks.drain()

    async def checked(tenant: str, text: str, end_user: str | None = None) -> None:
        checks.send(tenant, tier, _request(text), _hit(), TenantPolicy(), **isolated(end_user))
        await checks.tasks.drain()

    return {"direct": direct, "shadow": shadowed, "cache check": checked}


@pytest.mark.parametrize("path", ["direct", "shadow", "cache check"])
def test_one_tenants_failing_copies_leave_the_breaker_closed_for_the_others(path: str) -> None:
    """Six tenants' copies answered, then five of `evil`'s the tier answers with a 500: held as evil's, as its
    direct requests are (`direct`: the reference), the breaker stays closed. Before: open, for every tenant."""
    caller, fleet, client = _caller()
    send = _senders(caller)[path]

    async def scenario() -> None:
        for i in range(12):
            await send(f"t{i % 6}", f"a normal question {i}")
        for i in range(5):
            await send("evil", f"CHOKE {i}")

    asyncio.run(scenario())
    assert len(client.got) == 17  # every call reached the tier (none dropped)
    assert fleet.replica.breaker.state == "closed"
    for _ in range(5):  # the same failures, the gateway's own (no tenant), still open it: judged on what they have
        fleet.replica.breaker.begin()
        fleet.replica.breaker.failure("answered 500")
    assert fleet.replica.breaker.state == "open"


@pytest.mark.parametrize("path", ["shadow", "cache check"])
@pytest.mark.parametrize("tier", [VLLM, LOCAL], ids=["vllm", "local"])
@pytest.mark.parametrize("end_user", [None, "user=alice"])
def test_an_off_path_call_carries_the_tenants_salt_and_hashed_hints(path: str, tier: TierSpec,
                                                                     end_user: str | None) -> None:
    """The copy's body has the direct call's `cache_salt` (the tenant's, or its isolated end user's) and hashed
    `user` and `prompt_cache_key` (a vLLM), or its salt header (our engine). Before: none of them."""
    caller, _, client = _caller()
    senders = _senders(caller, tier)
    asyncio.run(senders["direct"]("acme", "hello", end_user))
    asyncio.run(senders[path]("acme", "hello", end_user))
    (direct, direct_salt), (copy, copy_salt) = client.got
    fields = ("user", "prompt_cache_key", "cache_salt")
    assert {f: copy.get(f) for f in fields} == {f: direct.get(f) for f in fields}
    assert copy_salt == direct_salt
    if tier is LOCAL:
        assert copy_salt is not None and (end_user is None) == ("." not in copy_salt)
    else:
        assert copy["cache_salt"] and copy["user"] != "alice" and copy["prompt_cache_key"] != "shared-doc"
        assert (end_user is None) == ("." not in copy["cache_salt"])
