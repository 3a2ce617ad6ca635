"""Parsing the report filters the CLI and the report routes share: --from/--to dates and --by groups."""

from __future__ import annotations

import calendar
import re

from quotas.report import GROUPS

DAY_PATTERN = r"([1-9][0-9]{3})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"  # years 1000-9999, days 01-31
_DAY = re.compile(DAY_PATTERN)


def parse_day(text: str | None, *, end: bool = False) -> float | None:
    """`YYYY-MM-DD` (UTC) to epoch seconds; an `end` day includes the whole day. A day past its month's end
    stands for the month's last day (`2026-02-31` is 28 February), as the report's pattern lets it through."""
    if not text:
        return None
    match = _DAY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a date like 2026-11-30")
    year, month, day = (int(part) for part in match.groups())
    day = min(day, calendar.monthrange(year, month)[1])
    start = calendar.timegm((year, month, day, 0, 0, 0))
    return float(start + 86400 if end else start)


def parse_by(text: str | None) -> tuple[str, ...]:
    groups = tuple(g.strip() for g in (text or "tenant,tier").split(",") if g.strip())
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ValueError(f"--by takes a comma list of {', '.join(GROUPS)}; got {text!r}")
    return groups
