"""Parsing the report filters the CLI and the report routes share: --from/--to dates and --by groups."""

from __future__ import annotations

import calendar
import time

from quotas.report import GROUPS


def parse_day(text: str | None, *, end: bool = False) -> float | None:
    """`YYYY-MM-DD` (UTC) to epoch seconds; an `end` day includes the whole day."""
    if not text:
        return None
    try:
        t = time.strptime(text, "%Y-%m-%d")
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a date like 2026-11-30") from exc
    start = calendar.timegm(t)
    return float(start + 86400 if end else start)


def parse_by(text: str | None) -> tuple[str, ...]:
    groups = tuple(g.strip() for g in (text or "tenant,tier").split(",") if g.strip())
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ValueError(f"--by takes a comma list of {', '.join(GROUPS)}; got {text!r}")
    return groups
