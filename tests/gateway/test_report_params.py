"""The report's date filter: what its published pattern lets through is parsed, never refused as malformed."""

from __future__ import annotations

import calendar
import re

import pytest

from gateway.report_params import DAY_PATTERN, parse_day


def test_a_day_past_the_month_end_is_the_months_last_day() -> None:
    assert parse_day("2026-02-31") == calendar.timegm((2026, 2, 28, 0, 0, 0))
    assert parse_day("2024-02-30", end=True) == calendar.timegm((2024, 3, 1, 0, 0, 0))  # 29 Feb, whole day
    assert parse_day("2026-11-30") == calendar.timegm((2026, 11, 30, 0, 0, 0))


@pytest.mark.parametrize("text", ["0000-01-01", "2026-13-01", "2026-00-10", "2026-1-1", "yesterday",
                                  "２０２６-01-01", "2026-01-01T00:00"])
def test_what_the_pattern_refuses_is_refused(text: str) -> None:
    assert re.fullmatch(DAY_PATTERN, text) is None
    with pytest.raises(ValueError, match="is not a date"):
        parse_day(text)


@pytest.mark.parametrize("text", ["1000-01-01", "9999-12-31", "2023-02-29", "2026-04-31"])
def test_what_the_pattern_accepts_is_parsed(text: str) -> None:
    assert re.fullmatch(DAY_PATTERN, text) is not None
    assert isinstance(parse_day(text), float)
