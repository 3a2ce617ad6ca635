"""The largest limit an operator may set (quotas/plans.py MAX_*) still limits, on memory and on a real redis-server,
whose scripts compare in Lua's doubles: a request that fits exactly is admitted, one more token, or one more
micro-dollar, is refused. (Above 2**53 picodollars, $9,007, Redis compares money to within 1024 picodollars, a
millionth of the micro-dollar here; memory counts it exactly.)"""

from __future__ import annotations

from decimal import Decimal

import pytest

from quotas.backends.base import QuotaBackend
from quotas.limits import ReservationRequest
from quotas.money import to_pico
from quotas.plans import MAX_BUDGET_USD, MAX_CONCURRENT, MAX_RPM, MAX_TPM, Limits
from quotas.reservations import scope_limits

MICRO_USD = 10**6  # picodollars
_n = iter(range(10**9))


def _request(limits: Limits, *, tokens: int = 1, money: int = 0) -> ReservationRequest:
    return ReservationRequest(f"max{next(_n)}", "acme", (scope_limits("t", limits),), tokens, money,
                              now=1_800_000_000.0)


def test_the_maxima_are_what_every_backend_counts_exactly() -> None:
    # Lua's doubles hold integers exactly to 2**53; Redis' INCRBY counters are int64
    assert max(MAX_RPM, MAX_TPM, MAX_CONCURRENT) <= 2**53
    assert to_pico(MAX_BUDGET_USD) < 2**63 and float(to_pico(MAX_BUDGET_USD)) == to_pico(MAX_BUDGET_USD)


async def test_the_largest_tpm_limits(backend: QuotaBackend) -> None:
    limits = Limits(tpm=MAX_TPM)
    assert (await backend.reserve(_request(limits, tokens=MAX_TPM))).admitted
    refused = await backend.reserve(_request(limits, tokens=1))
    assert not refused.admitted and refused.reason == "tpm"


@pytest.mark.parametrize("period", ["day", "month"])
async def test_the_largest_budget_limits(backend: QuotaBackend, period: str) -> None:
    limits = Limits(**{f"budget_{period}_usd": MAX_BUDGET_USD})
    assert (await backend.reserve(_request(limits, money=to_pico(MAX_BUDGET_USD) - MICRO_USD))).admitted
    assert (await backend.reserve(_request(limits, money=MICRO_USD))).admitted  # exactly the budget
    refused = await backend.reserve(_request(limits, money=MICRO_USD))
    assert not refused.admitted and refused.reason == f"budget_{period}"


async def test_the_largest_rpm_and_concurrency_are_no_limit_to_a_few_requests(backend: QuotaBackend) -> None:
    limits = Limits(rpm=MAX_RPM, max_concurrent=MAX_CONCURRENT)
    decisions = [await backend.reserve(_request(limits)) for _ in range(3)]
    assert all(d.admitted for d in decisions)
    assert decisions[-1].usage["t"].requests == 3


@pytest.mark.parametrize("limits", [Limits(rpm=0), Limits(tpm=0), Limits(max_concurrent=0), Limits(budget_day_usd=0),
                                    Limits(budget_month_usd=Decimal("0"))], ids=str)
async def test_a_limit_of_zero_admits_nothing(backend: QuotaBackend, limits: Limits) -> None:
    """0 is a limit (a paused plan or key), never read as "no limit"."""
    decision = await backend.reserve(_request(limits, tokens=1, money=1))
    assert not decision.admitted and decision.reason in ("rpm", "tpm", "concurrency", "budget_day", "budget_month")
