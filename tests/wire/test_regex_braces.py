"""wire/regex_costs.py reads a `{` that opens no counted repetition as a literal, in time linear in the pattern.

For every `{` it scanned ahead to the next `}` and copied and split what lay between: quadratic. A schema whose
`pattern` was `"{ " * 16300 + "}"` (a 32.6 KB chat body) held the gateway's event loop 6 s and was accepted. The
patterns here are 512 K characters: each is weighed in about a second now, and would take the old reading more than
an hour (past the suite's 600 s timeout). Every brace in them is a literal, so a pattern weighs its length, and its
fewest characters are its length too.
"""

from __future__ import annotations

import pytest

from wire.regex_costs import pattern_limit, pattern_min_chars, pattern_weight
from wire.schema_costs import check_patterns

SIZE = 1 << 19


@pytest.mark.parametrize("unit", ["{ ", "a{", "{1,", "{ 1 "])
def test_a_long_run_of_literal_braces_is_weighed_and_passes(unit: str) -> None:
    # `{ {`, `a{a`, `{1,{` and `{ 1 {` open no count; only the last unit with the `}` may: `{1,}` or `{ 1 }`, which
    # repeat the character before them at least once (it is counted already)
    pattern = unit * (SIZE // len(unit)) + "}"
    counted_at_end = unit in ("{1,", "{ 1 ")
    fewest = len(pattern) - (len(unit) + 1 if counted_at_end else 0)
    assert pattern_min_chars(pattern, 2 * SIZE) == fewest
    assert pattern_weight(pattern) <= pattern_limit(pattern) == len(pattern)
    check_patterns({"type": "string", "pattern": pattern})  # not refused: it repeats nothing much


@pytest.mark.parametrize(("pattern", "weight", "fewest"), [
    ("a{3}", 3, 3),
    ("a{3,}", 4, 3),
    ("a{3,5}", 5, 3),
    ("a{ 3 , 5 }", 5, 3),  # spaces inside are the count's
    ("a{\u00a03\u00a0}", 3, 3),  # any whitespace str.split drops
    ("a{1 0}", 10, 10),  # and between its digits
    ("(a{10}){10}", 100, 100),
    ("a{99999999999999999999}", 10_001, 10_001),  # past any bound, never turned into a number
    ("a{,5}", 5, 5),  # no least count: literals
    ("a{}", 3, 3),
    ("a{3,5,7}", 8, 8),
    ("a{\u0663}", 4, 4),  # a digit, but not an ASCII one
    ("a{3", 3, 3),
    ("\\p{L}{2}", 2, 2),  # the escape's braces, then a count
])
def test_counts_read_as_before(pattern: str, weight: int, fewest: int) -> None:
    assert (pattern_weight(pattern), pattern_min_chars(pattern, 10**6)) == (weight, fewest)
