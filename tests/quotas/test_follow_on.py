"""A cascade's second attempt continues its client's request (`ReservationRequest.follows`): it takes no new place
in the requests-per-minute window and takes over the first attempt's concurrency slot, so one client request holds
one of each for its whole life; its tokens and money are reserved and settled as any attempt's. Both backends."""

from __future__ import annotations

from dataclasses import replace

from quotas.backends.base import QuotaBackend
from quotas.limits import ScopeLimits
from tests.quotas.test_backends import res


async def test_a_follow_on_takes_over_the_slot_and_no_rpm_place(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t", rpm=2, max_concurrent=1, tpm=1000)
    first = res(lim, tokens=10)
    assert (await backend.reserve(first)).admitted
    second = replace(res(lim, tokens=30), follows=first.request_id)
    d = await backend.reserve(second)
    assert d.admitted, d  # the client's one slot, handed on
    assert d.usage["t"].requests == 1 and d.usage["t"].tokens == 40  # one request; both attempts' tokens
    await backend.settle(first, tokens=5, money_pico=10)  # the first attempt ends: the slot stays the second's
    other = await backend.reserve(res(lim))
    assert not other.admitted and other.reason == "concurrency"
    await backend.settle(second, tokens=20, money_pico=50)  # the client request ends: its slot is free, once
    third = res(lim)
    d = await backend.reserve(third)
    assert d.admitted and d.usage["t"].requests == 2, d  # the window holds two client requests, not three
    await backend.settle(third, tokens=1, money_pico=1)
    d = await backend.reserve(res(lim))
    assert not d.admitted and d.reason == "rpm"


async def test_a_refused_or_cancelled_follow_on_leaves_the_first_its_slot(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t", max_concurrent=1, budget_day_pico=1000)
    first = res(lim, money=100)
    assert (await backend.reserve(first)).admitted
    d = await backend.reserve(replace(res(lim, money=2000), follows=first.request_id))
    assert not d.admitted and d.reason == "budget_day"  # refused for money: the first still holds its slot
    assert (await backend.reserve(res(lim))).reason == "concurrency"
    second = replace(res(lim, money=500), follows=first.request_id)
    assert (await backend.reserve(second)).admitted
    await backend.settle(first, tokens=1, money_pico=100)
    await backend.settle(second, tokens=0, money_pico=0)  # never started: settled at zero, its slot freed
    after = res(lim, money=100)
    assert (await backend.reserve(after)).admitted  # the slot was freed exactly once: one request admitted
    assert (await backend.reserve(res(lim))).reason == "concurrency"


async def test_a_follow_on_whose_first_holds_no_slot_here_takes_one(backend: QuotaBackend) -> None:
    """The first attempt holds no slot in this store (reserved on another: Redis before it failed, the fail-open
    fallback before Redis came back; or settled): the retry takes a slot as any request does, refused where none is
    free, and still no place in the window."""
    lim = ScopeLimits("t", rpm=1, max_concurrent=1)
    other = res(lim)
    assert (await backend.reserve(other)).admitted
    retry = replace(res(lim), follows="elsewhere")
    d = await backend.reserve(retry)
    assert not d.admitted and d.reason == "concurrency", d
    await backend.settle(other, tokens=1, money_pico=1)
    d = await backend.reserve(retry)
    assert d.admitted and d.usage["t"].requests == 1, d  # a slot of its own; rpm 1 holds the other request alone
    assert (await backend.reserve(res(lim))).reason == "rpm"
    await backend.settle(retry, tokens=1, money_pico=1)
