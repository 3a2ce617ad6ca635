"""wire/regex_costs.py `pattern_min_chars`: the fewest characters a match of a pattern holds, a lower bound on an
answer's size (wire/schema_costs.py refuses a schema whose every answer holds more than 100,000). It counted what is
no character: the x flag's whitespace and comments, a group's opening (`(?:`, `(?<name>`, `(?i)`), lookarounds; an
answer's least size came out too large, and schemas whose answers fit were refused."""

from __future__ import annotations

import pytest

from wire.regex_costs import pattern_min_chars

MOST = 100_000


@pytest.mark.parametrize(("pattern", "fewest"), [
    ("(?x) a b c", 3),
    ("(?x)a b c", 3),
    ("(?x) a  # the a\n b", 2),  # a comment runs to the line's end
    ("(?x) a # ( [ { an unclosed group in a comment\n b", 2),
    ("(?x) a +", 1),  # the quantifier after the space still repeats the a
    ("(?x) (?: a b ){3}", 6),
    ("(?x)\\ a\\#", 3),  # escaped, a space and a # are characters
    ("(?x: a b ) c", 4),  # on within its group: the space before c counts
    ("(a(?x) b c) d", 5),  # on from (?x) to its group's end
    ("(?x)a(?-x) b", 3),  # and off again
    ("(?x)(?-x: a )b c", 5),
])
def test_the_x_flags_whitespace_and_comments_hold_no_characters(pattern: str, fewest: int) -> None:
    assert pattern_min_chars(pattern, MOST) == fewest


@pytest.mark.parametrize(("pattern", "fewest"), [
    ("(?:abc)", 3),
    ("^(?:[a-z]+)$", 1),
    ("(?P<pair>ab)", 2),
    ("(?<pair>ab){4}", 8),
    ("(?i)abc", 3),
    ("(?i:ab)c", 3),
    ("(?=ab)c", 1),  # a lookaround matches no character of its own
    ("(?<!ab)c", 1),
    ("\\Aab\\z", 2),  # the text's start and end, as \\b a boundary
])
def test_a_groups_opening_and_what_matches_no_character_hold_none(pattern: str, fewest: int) -> None:
    assert pattern_min_chars(pattern, MOST) == fewest


@pytest.mark.parametrize(("pattern", "fewest"), [
    ("^\\d{3}-\\d{4}$", 8),
    ("^[a-z]+@[a-z]+\\.[a-z]{2,}$", 6),
    ("^(a|bc)d$", 2),
    ("^(a{5000})?$", 0),
    ("^a{5000}$", 5000),
])
def test_patterns_without_groups_flags_or_x_count_as_before(pattern: str, fewest: int) -> None:
    assert pattern_min_chars(pattern, MOST) == fewest
