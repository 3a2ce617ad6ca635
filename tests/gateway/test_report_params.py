"""The report's date filter: what its published pattern lets through is parsed, never refused as malformed."""

from __future__ import annotations

import calendar
import datetime
import itertools
import re

import pytest

from gateway.report_params import BY_PATTERN, DAY_PATTERN, ReportParamError, parse_by, parse_by_query, parse_day
from quotas.report import GROUPS


@pytest.mark.parametrize(("text", "end"), [("2026-02-31", False), ("2024-02-30", True), ("2023-02-29", False),
                                         ("3016-11-31", True), ("2026-04-31", False), ("1900-02-29", False),
                                         ("2100-02-29", True)])
def test_a_day_past_the_month_end_is_refused_by_name(text: str, end: bool) -> None:
    """`2026-02-31` was read as 28 February (and `2024-02-30` as the 29th): a report of other days than asked."""
    with pytest.raises(ReportParamError, match="is not a date") as caught:
        parse_day(text, end=end)
    assert (caught.value.param, caught.value.code) == ("to" if end else "from", "invalid_value")
    assert re.fullmatch(DAY_PATTERN, text) is None  # the published pattern says so too


def test_the_pattern_is_the_calendars_days() -> None:
    """Every month and day number (00 to 32) of years of each kind, and 29 February of every year: the pattern
    takes a day exactly when datetime has it, and parse_day reads it as that day."""
    for year in (1000, 1600, 1900, 2000, 2023, 2024, 2100, 2400, 9996, 9999):
        for month, day in itertools.product(range(14), range(33)):
            text = f"{year}-{month:02d}-{day:02d}"
            try:
                real = datetime.date(year, month, day)
            except ValueError:
                real = None
            assert (re.fullmatch(DAY_PATTERN, text) is not None) == (real is not None), text
            if real is not None:
                assert parse_day(text) == calendar.timegm(real.timetuple())
                assert parse_day(text, end=True) == calendar.timegm(real.timetuple()) + 86400
    for year in range(1000, 10_000):
        assert (re.fullmatch(DAY_PATTERN, f"{year}-02-29") is not None) == calendar.isleap(year), year


@pytest.mark.parametrize("text", ["0000-01-01", "0999-12-31", "10000-01-01", "99999-01-01", "-2026-01-01",
                                  "2026-13-01", "2026-00-10", "2026-1-1", "yesterday", "２０２６-01-01",
                                  "2026-01-01T00:00", "2026-01-01\n"])
def test_what_the_pattern_refuses_is_refused(text: str) -> None:
    assert re.fullmatch(DAY_PATTERN, text) is None
    with pytest.raises(ValueError, match="is not a date"):
        parse_day(text)


@pytest.mark.parametrize("text", ["1000-01-01", "9999-12-31", "2024-02-29", "2000-02-29", "2026-04-30"])
def test_what_the_pattern_accepts_is_parsed(text: str) -> None:
    assert re.fullmatch(DAY_PATTERN, text) is not None
    assert isinstance(parse_day(text), float)


@pytest.mark.parametrize("text", ["tenant", "day,tier", "key_id , day,tier ,  tenant", "tenant,tier,day,key_id",
                                  "day,day", "tier, day ,tier", ",".join(["day"] * 5000), "tenant,tier,day,key_id,day",
                                  "planet", "day,", ",day", "tenant,,tier", "daytier", "tier,tiers", "day\ttier",
                                  "day\n", "DAY", ""])
def test_the_published_by_pattern_is_what_the_routes_read(text: str) -> None:
    """What the document allows for `by` is read, what it forbids is refused (a group named twice among them)."""
    try:
        groups = parse_by_query(text)
    except ReportParamError as exc:
        assert exc.param == "by" and exc.code in ("invalid_value", "duplicate_group")
        assert (exc.code == "duplicate_group") == (len(text.split(",")) != len({g.strip() for g in text.split(",")}))
        groups = None
    published = re.search(BY_PATTERN, text) is not None and not text.endswith("\n")  # JSON Schema's `$` is the end
    assert (groups is not None) == published, (text, groups)
    assert groups is None or len(groups) == len(set(groups)) <= len(GROUPS)


def test_a_group_named_twice_is_refused_before_the_ledger_reads_it() -> None:
    with pytest.raises(ReportParamError, match="day more than once") as caught:
        parse_by(",".join(["day"] * 5000))
    assert (caught.value.param, caught.value.code) == ("by", "duplicate_group")
    assert parse_by("day, tenant") == ("day", "tenant")


@pytest.mark.parametrize(("end", "param"), [(False, "from"), (True, "to")])
def test_a_bad_day_names_its_filter(end: bool, param: str) -> None:
    with pytest.raises(ReportParamError) as caught:
        parse_day("x" * 10_000, end=end)
    assert (caught.value.param, caught.value.code) == (param, "invalid_value") and len(str(caught.value)) < 200
