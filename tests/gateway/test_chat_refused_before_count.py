"""Cheap refusals come before expensive work: a chat (or text completion) request whose prompt is long to count holds
a floor of its tokens (what no count can go below) before it is counted, so a tenant over its request rate, its
concurrency, a budget already spent, or tokens per minute that even the floor does not fit is refused (the same 429
as before) without its prompt being tokenized; counted first, each such request cost up to the body limit's count
(gateway/pipeline/handle.py's `_prepare`). A request that fits is still reserved, and settled, at its exact count;
and the checks that cost nothing (a model unknown, a parameter refused, a plan missing) still come first of all."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from gateway.pipeline import prompt as prompt_module
from gateway.settings import Settings
from quotas.plans import Limits
from tests.conftest import Gateway, running_gateway
from tests.stubs import StubState

LONG = "The gateway counts every prompt with the tier's own tokenizer before it reserves. " * 200  # 16 KB, 3,000 tokens


class Counts:
    """Every long prompt the prompt stage tokenizes (its worker-thread count), recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = prompt_module._count_bounded

        def spy(*args: Any) -> Any:
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(prompt_module, "_count_bounded", spy)


class Reserves:
    """The pipeline's reservations asked (request id's end, tokens, admitted) and settled (request id's end, tokens)."""

    def __init__(self, gateway: Gateway) -> None:
        self.asked: list[tuple[str, int, bool]] = []
        self.settled: list[tuple[str, int]] = []
        reserve = gateway.app.state.services.pipeline.reserve
        quotas = reserve.quotas
        real_reserve, real_settle, real_settle_now = quotas.reserve, quotas.settle, quotas.settle_now

        async def spy_reserve(**kw: Any) -> Any:
            decision, reservation = await real_reserve(**kw)
            self.asked.append((_kind(kw["request_id"]), kw["tokens"], reservation is not None))
            return decision, reservation

        async def spy_settle(reservation: Any, **kw: Any) -> None:
            self.settled.append((_kind(reservation.request.request_id), kw["tokens"]))
            await real_settle(reservation, **kw)

        def spy_settle_now(reservation: Any, **kw: Any) -> None:
            self.settled.append((_kind(reservation.request.request_id), kw["tokens"]))
            real_settle_now(reservation, **kw)

        quotas.reserve, quotas.settle, quotas.settle_now = spy_reserve, spy_settle, spy_settle_now


def _kind(request_id: str) -> str:
    return "floor" if request_id.endswith(":floor") else "exact"


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    return Counts(monkeypatch)


@pytest.fixture(params=["memory", "redis"])
def either(request: pytest.FixtureRequest, gateway_settings: Settings,
           stub: tuple[Any, StubState]) -> Iterator[Gateway]:
    """A gateway on the embedded quota store, or on Redis (its Lua reserve and settle)."""
    settings = gateway_settings
    if request.param == "redis":
        settings = settings.model_copy(update={"redis_url": request.getfixturevalue("redis_url")})
    with running_gateway(settings, stub[1]) as gw:
        yield gw


def key_with(gateway: Gateway, limits: Limits) -> tuple[str, str]:
    key, secret = gateway.store.issue_key("acme", name="limited", limits=limits)
    return key.key_id, secret


def chat(gateway: Gateway, key: str, content: str, **fields: Any) -> Any:
    with gateway.client(key) as c:
        return c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": content}],
                                                    "max_tokens": 8, **fields}, timeout=60)


def test_a_key_over_its_rpm_is_refused_before_its_prompt_is_counted(either: Gateway, counts: Counts) -> None:
    _, key = key_with(either, Limits(rpm=1))
    assert chat(either, key, "hi").status_code == 200
    refused = chat(either, key, LONG)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_rpm"
    assert counts.calls == 0


def test_a_text_completion_over_its_rpm_is_refused_before_its_prompt_is_counted(gateway: Gateway,
                                                                               counts: Counts) -> None:
    _, key = key_with(gateway, Limits(rpm=1))
    assert chat(gateway, key, "hi").status_code == 200
    with gateway.client(key) as c:
        refused = c.post("/v1/completions", json={"model": "mid", "prompt": LONG, "max_tokens": 8})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_rpm"
    assert counts.calls == 0


def test_a_key_with_its_budget_spent_is_refused_before_its_prompt_is_counted(either: Gateway,
                                                                            counts: Counts) -> None:
    _, key = key_with(either, Limits(budget_day_usd=Decimal("0")))
    refused = chat(either, key, LONG)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert counts.calls == 0
    assert either.ledger_rows() == []


def test_a_key_whose_tpm_cannot_hold_even_the_floor_is_refused_before_its_prompt_is_counted(
        either: Gateway, counts: Counts) -> None:
    _, key = key_with(either, Limits(tpm=150))
    assert chat(either, key, "hi").status_code == 200  # settled to its use: a few tokens of the 150 taken
    refused = chat(either, key, LONG)  # 16 KB: at least 16,400 / 81 characters a token + 8 = 211 tokens
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_tpm"
    assert counts.calls == 0


def test_a_key_at_its_concurrency_on_another_replica_is_refused_before_its_prompt_is_counted(
        gateway: Gateway, counts: Counts) -> None:
    key_id, key = key_with(gateway, Limits(max_concurrent=1))
    pipeline = gateway.app.state.services.pipeline
    # another replica's request holds the key's one slot (this replica's gate sees none in flight)
    plan = gateway.app.state.services.plans.plans[gateway.store.get_tenant("acme").plan]
    quotas = pipeline.reserve.quotas
    _, held = asyncio.run(quotas.reserve(request_id="elsewhere", tenant="acme", plan=plan, key_id=key_id,
                                         key_limits=Limits(max_concurrent=1), tokens=1, price=Decimal(0)))
    assert held is not None
    refused = chat(gateway, key, LONG)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_concurrency"
    assert counts.calls == 0


def test_a_long_prompt_that_fits_is_reserved_and_settled_at_its_exact_count(either: Gateway,
                                                                           counts: Counts) -> None:
    spy = Reserves(either)
    _, key = key_with(either, Limits(tpm=100_000))
    answer = chat(either, key, LONG)
    assert answer.status_code == 200, answer.text
    assert counts.calls == 1
    floor, exact = spy.asked
    counted = either.app.state.services.pipeline.prompt._counter(
        either.app.state.services.catalogue.tiers["mid"]).prompt_tokens([{"role": "user", "content": LONG}])
    assert exact == ("exact", counted + 8, True)  # the prompt's exact count and its max_tokens, as before
    assert floor == ("floor", -(-len(LONG) // 81) + 8, True)  # its characters over the longest token's, and its cap
    assert spy.settled[0] == ("floor", 0)  # the floor given back, nothing of it used
    row = either.ledger_rows()[-1]  # the exact reservation is the one settled, to the answer's use
    assert spy.settled[1:] == [("exact", row.input_tokens + row.output_tokens)]


def test_a_short_prompt_is_reserved_once_at_its_exact_count(gateway: Gateway) -> None:
    spy = Reserves(gateway)
    _, key = key_with(gateway, Limits(tpm=100_000))
    answer = chat(gateway, key, "hello there")
    assert answer.status_code == 200, answer.text
    assert [(kind, admitted) for kind, _, admitted in spy.asked] == [("exact", True)]
    assert [kind for kind, _ in spy.settled] == ["exact"]


@pytest.mark.parametrize("body, status, code", [
    ({"model": "nope", "messages": [{"role": "user", "content": LONG}]}, 404, "model_not_found"),
    ({"model": "mid", "messages": [{"role": "user", "content": LONG}], "temperature": 9}, 400, None),
])
def test_a_request_refused_for_its_model_or_parameters_is_neither_counted_nor_reserved(
        gateway: Gateway, counts: Counts, body: dict[str, Any], status: int, code: str | None) -> None:
    spy = Reserves(gateway)
    with gateway.client(gateway.tenant_key) as c:
        refused = c.post("/v1/chat/completions", json=body)
    assert refused.status_code == status, refused.text
    if code is not None:
        assert refused.json()["error"]["code"] == code
    assert counts.calls == 0 and spy.asked == []


def test_a_tenant_whose_plan_is_missing_is_neither_counted_nor_reserved(gateway: Gateway, counts: Counts) -> None:
    spy = Reserves(gateway)
    gateway.store.create_tenant("orphan", "standard")
    _, key = gateway.store.issue_key("orphan", name="k")
    del gateway.app.state.services.plans.plans["standard"]  # the plans file lost it while its tenants are on it
    with gateway.client(key) as c:
        refused = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": LONG}]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "plan_not_configured", refused.text
    assert counts.calls == 0 and spy.asked == []
