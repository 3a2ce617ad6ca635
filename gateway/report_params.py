"""Parsing the report filters the CLI and the report routes share: --from/--to dates and --by groups.

A filter that cannot be read raises ReportParamError, a ValueError that names the filter (`from`, `to`, `by`) and
the kind of fault, so the routes answer a 400 with its `param` and `code` (the CLI prints the message).
"""

from __future__ import annotations

import calendar
import re
from collections import Counter

from quotas.report import GROUPS

# a calendar day of the years 1000-9999 (UTC, proleptic Gregorian), and nothing else: a day past its month's end
# (`2026-02-31`, `2023-02-29`, `3016-11-31`) is no day, and the published pattern refuses it as parse_day does
_LEAP_YEAR = "(?:[1-9][0-9](?:0[48]|[2468][048]|[13579][26])|(?:[2468][048]|[13579][26])00)"  # by 4, centuries by 400
DAY_PATTERN = ("(?:[1-9][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
               f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_DAY = re.compile(DAY_PATTERN)


_GROUP = "(" + "|".join(GROUPS) + ")"
_EACH_ONCE = "".join(rf"(?!(.*\b{group}\b){{2}})" for group in GROUPS)  # linear: the 2nd `.*` starts once at most
# `by` as the report routes publish it: a comma list of distinct groups (so at most one of each); read by
# parse_by_query as `_BY_LIST` and then parse_by, which words each refusal (a regex in the message helps nobody)
BY_PATTERN = f"^{_EACH_ONCE}{_GROUP}( *, *{_GROUP}){{0,{len(GROUPS) - 1}}}$"
_BY_LIST = re.compile(f"{_GROUP}( *, *{_GROUP})*")


class ReportParamError(ValueError):
    """A report filter that cannot be read: `param` is the filter (from, to, by), `code` the kind of fault."""

    def __init__(self, message: str, *, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def parse_day(text: str | None, *, end: bool = False) -> float | None:
    """`YYYY-MM-DD` (UTC) to epoch seconds; an `end` day includes the whole day. A day past its month's end is
    refused as any other that is not a date (DAY_PATTERN): `2026-02-31` stood for 28 February, a report of other days
    than asked, with a 200."""
    if not text:
        return None
    if _DAY.fullmatch(text) is None:
        raise ReportParamError(f"{_shown(text)} is not a date like 2026-11-30 (a day of its month, years 1000-9999)",
                               param="to" if end else "from")
    year, month, day = (int(part) for part in text.split("-"))
    start = calendar.timegm((year, month, day, 0, 0, 0))
    return float(start + 86400 if end else start)


def parse_by(text: str | None) -> tuple[str, ...]:
    """The report's groups, in order, each at most once (so at most len(GROUPS) of them): a group named twice
    adds nothing to the report but a column the ledger's query computes for every row again, and `day` 5,000
    times was a query SQLite refused (too many columns: a 500), 1,900 times a 30-second read of a 50k-row ledger."""
    groups = tuple(g.strip() for g in (text or "tenant,tier").split(",") if g.strip())
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ReportParamError(f"groups are a comma list of {', '.join(GROUPS)}; got {_shown(text)}", param="by")
    twice = sorted(g for g, n in Counter(groups).items() if n > 1)
    if twice:
        raise ReportParamError(f"groups are named once each; got {', '.join(twice)} more than once", param="by",
                               code="duplicate_group")
    return groups


def parse_by_query(text: str | None) -> tuple[str, ...]:
    """`by` as a report route's query has it: what BY_PATTERN allows (groups, commas, spaces around them), each
    group once; parse_by's result."""
    if text is not None and _BY_LIST.fullmatch(text) is None:
        raise ReportParamError(f"groups are a comma list of {', '.join(GROUPS)}; got {_shown(text)}", param="by")
    return parse_by(text)


def _shown(text: str | None, limit: int = 80) -> str:
    """`text` quoted for an error message, cut at `limit` characters (a query string may be kilobytes long)."""
    return repr(text) if text is None or len(text) <= limit else f"{text[:limit]!r}..."
