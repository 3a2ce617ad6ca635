"""A rollout's candidate that cannot be reached is passed over for its baseline (gateway/pipeline/open_tier.py), and
the baseline is opened as the candidate was: for the same tenant and, under a plan isolating its end users, the same
end user's prefix-cache namespace. Before: the fallback's call left out `end_user`, so that request's prompt went into
the tenant-wide namespace, where the tenant's other end users could time its cached prefix."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.pipeline import open_tier as open_tier_module
from gateway.pipeline.open_tier import open_tier
from tiers.errors import NoTierAvailable, UpstreamUnreachable
from wire.chat_request import ChatCompletionRequest


@dataclass(frozen=True)
class _Lookup:
    scope: object


@dataclass(frozen=True)
class _Attempt:
    route: object
    lookup: _Lookup


class _Tiers:
    """A TierCaller whose candidate cannot be reached (`failure`); it records every call's tier and arguments."""

    def __init__(self, failure: Exception) -> None:
        self.failure = failure
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def open(self, tier: Any, body: dict[str, Any], **kwargs: Any) -> str:
        self.calls.append((tier.name, kwargs))
        if tier.name == "candidate":
            raise self.failure
        return "stream"


class _Dispatch:
    async def acquire(self, *args: Any) -> str:
        return "ticket"

    def release(self, *args: Any) -> None:
        raise AssertionError("the slot is the caller's once the stream is open")


@pytest.mark.parametrize("failure", [UpstreamUnreachable("down"), NoTierAvailable("none up")])
@pytest.mark.parametrize("isolate", [True, False])
def test_the_fallback_is_opened_with_the_candidates_arguments(
        monkeypatch: pytest.MonkeyPatch, failure: Exception, isolate: bool) -> None:
    monkeypatch.setattr(open_tier_module, "tier_body", lambda ctx, prepared, tier, reading: {"tier": tier.name})
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "alice"})
    ctx = SimpleNamespace(tenant="acme", headers={"x-session-id": "s1"},
                          plan=SimpleNamespace(cache=SimpleNamespace(isolate_users=isolate), priority="normal"))
    candidate, baseline = SimpleNamespace(name="candidate"), SimpleNamespace(name="baseline")
    route = SimpleNamespace(fall_back=lambda decision: SimpleNamespace(tier=baseline))
    prepared = SimpleNamespace(attempt=_Attempt(SimpleNamespace(tier=candidate), _Lookup("scope")),
                               prompt=SimpleNamespace(num_tokens=1, output_cap=1), req=req)
    meter = SimpleNamespace(upstream_started=lambda: None, upstream_ended=lambda: None)
    tiers = _Tiers(failure)

    ticket, stream, attempt = asyncio.run(open_tier(_Dispatch(), tiers, route, ctx, prepared, meter, None))  # type: ignore[arg-type]

    assert (ticket, stream) == ("ticket", "stream")
    assert attempt.route.tier is baseline and attempt.lookup.scope is None
    (first, first_args), (second, second_args) = tiers.calls
    assert (first, second) == ("candidate", "baseline")
    assert second_args == first_args  # the same tenant, end user, affinity and on_sent
    assert first_args["tenant"] == "acme"
    assert first_args["end_user"] == ("user=alice" if isolate else None)
