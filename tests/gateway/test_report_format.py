"""A usage report's CSV, as finance's spreadsheet reads it: a text cell is never a formula (OWASP's "CSV Injection":
a leading `=`, `+`, `-`, `@`, tab or CR gets a `'`), commas, quotes and line ends stay inside their cell, and the
report's numbers (a negative margin among them) stay numbers."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

import pytest

from gateway.report_format import to_csv

HOSTILE = ["=HYPERLINK(\"http://x\",\"y\")", "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\tx", "\rx"]


@pytest.mark.parametrize("text", HOSTILE)
def test_a_text_cell_that_would_be_a_formula_is_written_as_text(text: str) -> None:
    rows = [{"tenant": text, "tier": "mid", "requests": 3, "margin_usd": Decimal("-0.25"), "refusals": {}}]
    (header, row) = list(csv.reader(io.StringIO(to_csv(rows))))
    assert header == ["tenant", "tier", "requests", "margin_usd", "refusals"]
    assert row == ["'" + text, "mid", "3", "-0.25", ""]


def test_a_count_cell_led_by_a_formula_is_written_as_text() -> None:
    rows = [{"tenant": "acme", "refusals": {"=x": 1, "rate_limit_rpm": 2}}]
    (_, row) = list(csv.reader(io.StringIO(to_csv(rows))))
    assert row == ["acme", "'=x=1;rate_limit_rpm=2"]


def test_commas_quotes_and_line_ends_stay_in_their_cell() -> None:
    rows = [{"tenant": 'a,"b"\r\nc', "tier": None, "refusals": {"rate_limit_rpm": 2}}]
    (_, row) = list(csv.reader(io.StringIO(to_csv(rows), newline="")))
    assert row == ['a,"b"\r\nc', "-", "rate_limit_rpm=2"]


def test_no_rows_is_the_header_alone() -> None:
    """A period of no use was an empty CSV body: a script or a spreadsheet found no columns to read."""
    assert to_csv([], header=("tenant", "requests")) == "tenant,requests\r\n"
    assert to_csv([]) == ""
