"""wire/regex_costs.py reads comments as Python's `re` (sre_parse) does: a `(?#...)` comment ends at its first `)`
that no backslash escapes, whatever its text holds, and where the x flag is on a `#` runs to the line's end. The
fewest characters read a comment's `(`, `[` and `|` as syntax, and a quantifier after a comment repeated nothing;
the weight counted both kinds of comment as pattern (`(?x)a # b{20000}` was refused as too heavy). Each pattern here
is checked against re's own reading: its least width (`getwidth`), or the same parse as the pattern without its
comments."""

from __future__ import annotations

import re

import pytest

from wire.regex_costs import MAX_PATTERN_WEIGHT, pattern_limit, pattern_min_chars, pattern_weight

MOST = 100_000


def re_fewest(pattern: str) -> int:
    """The least width of a match as re's own parser reads `pattern`."""
    return re._parser.parse(pattern).getwidth()[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("pattern", [
    "(?#a)b",
    "(?#(a)bc",  # a `(` in the comment opens no group
    "(?#[)bc",  # nor a `[` a class
    "(?#a|)bc",  # nor a `|` an alternative
    "(?#a\\)b)c",  # an escaped `)` does not end it
    "(?#a{9})bc",
    "a(?#c)*b",  # the quantifier repeats the a
    "a(?#c){3}",
    "(a(?#)|b)?c",
    "x(?#(((){2}",
    "(?x)a#b{5}\nc",
    "(?x)(?#a # b)c d",
    "(?x)a # ( [ { comment\n b",
    "(?x)a # a ) in an x comment\n b{3}",
])
def test_the_fewest_characters_are_res(pattern: str) -> None:
    assert pattern_min_chars(pattern, MOST) == re_fewest(pattern)


@pytest.mark.parametrize(("pattern", "without_comments"), [
    ("(?x)a # b{20000}", "(?x)a"),
    ("(?x)a # b{200} ( [\nc{3}", "(?x)a\nc{3}"),
    ("(?x:a # b{20000}\n)c", "(?x:a)c"),
    ("(?#a{20000})b", "b"),
    ("(?#(a{200}{200})b", "b"),  # a `(` in the comment opens no group
    ("a(?#c){300}", "a{300}"),
    ("(?#a\\)b{20000})c", "c"),
    ("(?x)(a{100}) # the group, repeated:\n {100}", "(a{100}){100}"),
])
def test_a_comment_weighs_nothing(pattern: str, without_comments: str) -> None:
    assert repr(re._parser.parse(pattern)) == repr(re._parser.parse(without_comments))  # type: ignore[attr-defined]
    assert pattern_weight(pattern) == pattern_weight(without_comments) <= pattern_limit(pattern)


@pytest.mark.parametrize("pattern", [
    "(?x:a)#{20000}",  # the x flag is off past its group: the # is an atom, repeated
    "(?i)#{20000}",
    "(?x)a(?-x:#{20000})",
    "(?x)a # a comment ends at its newline, escaped or not, as llguidance ends it\\\nb{20000}",
])
def test_what_is_no_comment_still_weighs(pattern: str) -> None:
    assert pattern_weight(pattern) > pattern_limit(pattern) == MAX_PATTERN_WEIGHT
