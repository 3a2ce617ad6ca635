"""Report rows as CSV or as a plain-text table (the CLI), money exact."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal
from typing import Any


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return ";".join(f"{k}={n}" for k, n in sorted(v.items()))
    if v is None:
        return "-"
    return str(v) if not isinstance(v, Decimal) else format(v, "f")


def to_csv(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(rows[0].keys())
    for r in rows:
        writer.writerow(_cell(v) for v in r.values())
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
