"""The dates a reservation is counted under: the same strings as formatting its own time, at every boundary."""

from __future__ import annotations

import random
import time

import pytest

from quotas.limits import ReservationRequest


def _at(now: float) -> ReservationRequest:
    return ReservationRequest("r1", "acme", (), 10, 10, now=now)


@pytest.mark.parametrize("now", [0.0, -0.5, 86399.999999, 86400.0, 951782399.999999, 951782400.0,  # 2000-02-29
                                 1_735_689_599.999, 1_735_689_600.0, 4_102_444_799.5])
def test_day_and_month_at_boundaries(now: float) -> None:
    assert _at(now).day == time.strftime("%Y%m%d", time.gmtime(now))
    assert _at(now).month == time.strftime("%Y%m", time.gmtime(now))


def test_day_and_month_anywhere() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        now = rng.uniform(0, 4.1e9)
        assert (_at(now).day, _at(now).month) == (time.strftime("%Y%m%d", time.gmtime(now)),
                                                  time.strftime("%Y%m", time.gmtime(now)))
