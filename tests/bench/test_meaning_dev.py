"""bench/meaning_dev.py's read-whole margin rule and what it serves: read on synthetic rows, no model."""

from __future__ import annotations

import pytest

from bench.meaning_dev import accepted, whole_only_margin
from cache.meaning_check import ACCEPT_MARGIN


def row(kind: str, score: float, *, minimal: bool, cosine: float = 0.9, guard: str | None = None) -> dict:
    return {"kind": kind, "cosine": cosine, "guard": guard, "forward": score, "backward": score + 1.0,
            "minimal": minimal}


def test_the_read_whole_margin_lets_at_most_two_percent_of_non_minimal_edits_through() -> None:
    edits = [row("direction (split)", -5.0 + i * 0.04, minimal=False) for i in range(100)]  # -5.00 .. -1.04
    others = [row("antonym (split)", 3.0, minimal=True), row("paraphrase:gptcache", 3.0, minimal=False)]
    margin = whole_only_margin(edits + others)  # minimal edits and paraphrases do not count
    assert sum(min(r["forward"], r["backward"]) >= margin for r in edits) <= 2
    assert margin == pytest.approx(-1.05)  # the 98% quantile's score above (-1.08), rounded up to 0.05


def test_only_pairs_read_whole_take_the_read_whole_margin() -> None:
    low = ACCEPT_MARGIN - 0.5
    assert accepted(row("paraphrase:gptcache", low, minimal=False), None, whole_only=low)
    assert not accepted(row("paraphrase:gptcache", low, minimal=True), None, whole_only=low)
    assert not accepted(row("paraphrase:gptcache", low, minimal=False), None)  # ACCEPT_MARGIN by default
    assert not accepted(row("paraphrase:gptcache", 0.0, minimal=False, guard="numbers differ"), None)
