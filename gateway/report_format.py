"""Report rows as CSV or as a plain-text table (the CLI), money exact.

A CSV is opened in a spreadsheet by finance, which reads a cell starting with `=`, `+`, `-` or `@` as a formula
(and one starting with a tab or CR after the spreadsheet strips it): a text cell that does is written with a `'`
before it, as OWASP's "CSV Injection" advises, so it is shown as the text it is. The report's text cells today are
names the gateway checks (tenants: NAME_RE, tiers from the operator's files, key ids, refusal codes), none of which
can start so; the rule is here so that a group or column added later, or a name checked less, cannot become a
formula in finance's spreadsheet. Numbers are the report's own (a negative margin is `-0.5`) and stay numbers, as
does the lone `-` that stands for no value.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from decimal import Decimal
from typing import Any


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return ";".join(f"{k}={n}" for k, n in sorted(v.items()))
    if v is None:
        return "-"
    return str(v) if not isinstance(v, Decimal) else format(v, "f")


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet may read as the start of a formula


def _csv_cell(v: Any) -> str:
    """`_cell(v)`, and a text that a spreadsheet would read as a formula with a `'` before it (quoting of commas,
    quotes and line ends is the csv module's)."""
    text = _cell(v)
    if v is None or (isinstance(v, int | float | Decimal) and not isinstance(v, bool)):
        return text  # a number of the report's, or its "-" for none: no formula
    return "'" + text if text.startswith(_FORMULA_START) else text


def to_csv(rows: list[dict[str, Any]], header: Sequence[str] = ()) -> str:
    """The rows under their column names; no rows is `header` alone (a spreadsheet or a script reading a period of
    no use finds its columns, where an empty body had none)."""
    if not rows and not header:
        return ""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(_csv_cell(k) for k in (rows[0] if rows else header))
    for r in rows:
        writer.writerow(_csv_cell(v) for v in r.values())
    return out.getvalue()


def to_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no usage in this period)"
    headers = list(rows[0].keys())
    cells = [[_cell(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def to_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps([{k: _cell(v) if isinstance(v, Decimal) else v for k, v in r.items()} for r in rows], indent=2)
