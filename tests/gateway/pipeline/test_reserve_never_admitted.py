"""A request no window or budget could ever admit (limit_errors.py `too_large`) is refused as the request's own fault
(refusals.py `tenants_fault`: charged to the tenant's bucket of refused requests), and not told to the gate: a
normal-sized request of the scope right after it is admitted. Before: the gate remembered it for a second and refused
every request of the scope meanwhile (429 `rate_limit_never_admitted`; before that, 'the daily budget of your tenant
is spent', with nothing spent)."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest

from gateway.errors import TiergateError
from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import TenantGate, scopes_of
from gateway.pipeline.limit_errors import NeverAdmitted
from gateway.pipeline.refusals import tenants_fault
from gateway.pipeline.reserve import ReserveStage
from gateway.tenants.records import ApiKey, Principal, Tenant
from quotas.backends.memory import MemoryBackend
from quotas.plans import Limits, Plan
from quotas.reservations import QuotaService

LIMITS = Limits(tpm=1000, budget_day_usd=Decimal("1"), budget_month_usd=Decimal("10"))
PLAN = Plan(allowed_tiers=["mid"], default_tier="mid", limits=LIMITS)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ctx(request_id: str, key_limits: Limits | None) -> RequestContext:
    key = ApiKey("k1", "acme", "k", ("user",), 0.0, None, None, None, limits=key_limits)
    return RequestContext(request_id, Principal(key, Tenant("acme", "pro", 0.0)), PLAN, {}, time.time(),
                          time.perf_counter())


@pytest.mark.parametrize(("tokens", "price", "key_limits", "label"), [
    (10, Decimal("2"), None, "your tenant"),  # over the tenant's daily budget
    (10, Decimal("20"), None, "your tenant"),  # over its monthly budget
    (5000, Decimal("0"), None, "your tenant"),  # over its tokens per minute
    (10, Decimal("0.5"), Limits(budget_day_usd=Decimal("0.1")), "your key"),  # over the key's own daily budget
])
async def test_a_request_that_fits_right_after_one_never_admitted_is_admitted(
        tokens: int, price: Decimal, key_limits: Limits | None, label: str) -> None:
    clock = Clock()
    gate = TenantGate(clock)
    stage = ReserveStage(quotas=QuotaService(MemoryBackend()), gate=gate)
    with pytest.raises(TiergateError) as never:
        await stage.reserve(ctx("r1", key_limits), "r1", tokens=tokens, price=price)
    refused = never.value
    assert "can never be admitted" in refused.message and label in refused.message and refused.retry_after is None
    assert isinstance(refused, NeverAdmitted) and refused.status_code == 429 and tenants_fault(refused)
    entry = gate.enter(scopes_of("acme", "k1", LIMITS, key_limits))  # at once, the clock not moved: nothing used up
    held = await stage.reserve(ctx("r2", key_limits), "r2", tokens=10, price=Decimal("0.01"))
    assert held.decision.admitted
    await stage.quotas.settle(held, tokens=10, price=Decimal("0.01"))
    entry.leave()
