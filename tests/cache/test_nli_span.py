"""Where two questions differ, for the meaning check to read alone (cache/nli_span.py)."""

from __future__ import annotations

import pytest

from cache.nli_span import minimal_pair


@pytest.mark.parametrize(("a", "b", "place"), [
    ("How do I play a game?", "How do I display a game?", ("I play a", "I display a")),
    ("play chess", "display chess", ("play chess", "display chess")),  # at the start: the context after only
    ("Is it safe?", "Is it not safe?", ("it safe", "it not safe")),  # a word added: the other side is context
    ("Give 3 ideas.", "Give 3 ideas!", ("ideas .", "ideas !")),  # punctuation is a word of its own
    ("Write in bullet points please", "Write in paragraphs please", ("in bullet points please",
                                                                     "in paragraphs please")),
])
def test_the_changed_place_with_a_word_either_side(a: str, b: str, place: tuple[str, str]) -> None:
    assert minimal_pair(a, b) == place
    assert minimal_pair(b, a) == place[::-1]


@pytest.mark.parametrize(("a", "b"), [
    ("How do I play a game?", "How do I play a game?"),
    ("How do I play a game?", "how do I PLAY a game?"),  # case aside, nothing changed
    ("How do I convert a string to an integer?", "In Python, how can I turn a string into an integer?"),
    ("a b c d e f", "a w x y z f"),  # four words changed: read whole only
])
def test_pairs_that_differ_in_no_place_or_more_than_a_phrase_are_not_minimal(a: str, b: str) -> None:
    assert minimal_pair(a, b) is None


def test_repeated_words_are_not_counted_twice() -> None:
    """The shared end never overlaps the shared start: "a a" / "a a a" differ by one "a" added, not by a negative
    span; the place is that "a" after a word of context."""
    assert minimal_pair("a a", "a a a") == ("a", "a a")
