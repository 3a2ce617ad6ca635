from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from tests.engine.fakes import CharTokenizer


def feed_all(detok: IncrementalDetokenizer, text: str) -> list[str]:
    out = []
    for ch in text:
        out.append(detok.feed(ord(ch)))
        if detok.stopped:
            break
    return out


def test_streams_every_character_without_stops() -> None:
    d = IncrementalDetokenizer(CharTokenizer(), [])
    assert feed_all(d, "abc") == ["a", "b", "c"]


def test_stop_string_cuts_the_text_and_never_leaks_a_prefix_of_it() -> None:
    d = IncrementalDetokenizer(CharTokenizer(), ["END"])
    pieces = feed_all(d, "okENxEND tail")
    assert d.stopped and "".join(pieces) == "okENx" and d.text == "okENx"
    # "EN" was held back until "x" showed it was not the stop string
    assert pieces[:4] == ["o", "k", "", ""]


def test_flush_returns_held_text_when_the_sequence_ends_otherwise() -> None:
    d = IncrementalDetokenizer(CharTokenizer(), ["END"])
    assert "".join(feed_all(d, "abE")) == "ab"
    assert d.flush() == "E"
