"""Texts are keyed and guarded as sent: what NFKC or collapsing whitespace would fold together ("2³" and "23", an
indented line and an unindented one) is another question, to the exact layer and, through the guards, to the
semantic layer; only the embedding reads the normalized text."""

from __future__ import annotations

import importlib

import pytest

from cache import Hit, SemanticCache, TenantPolicy, guards, request_key
from cache.request_key import _digest, _turn, context_hash, normalize_text
from tests.cache.conftest import chat, scope

keys = importlib.import_module("cache.request_key")  # the module (`cache.request_key` is also the function)
LAYOUT_DIFFERS = "layout differs"
QUOTES_DIFFER = "quoted text differs"

LOOP_INSIDE = "What does this Python print?\nfor i in range(3):\n    x = i\n    print(x)"
LOOP_AFTER = "What does this Python print?\nfor i in range(3):\n    x = i\nprint(x)"

# (stored, asked): one folds into the other under NFKC or collapsed whitespace, and they have other answers
FOLDED_APART = [
    ("Is 2³ a prime number?", "Is 23 a prime number?"),
    ("What is 10² in decimal?", "What is 102 in decimal?"),
    (LOOP_INSIDE, LOOP_AFTER),
    ('What does print("a  b") show?', 'What does print("a b") show?'),
]
IDS = ["superscript-3", "superscript-2", "indentation", "spaces-in-a-string"]


@pytest.mark.parametrize(("stored", "asked"), FOLDED_APART, ids=IDS)
def test_the_exact_key_tells_them_apart(stored: str, asked: str) -> None:
    assert request_key(chat(stored)).exact_key != request_key(chat(asked)).exact_key
    assert request_key(chat(asked)).last_user_text == asked  # read by the guards as sent


@pytest.mark.parametrize(("stored", "asked"), FOLDED_APART, ids=IDS)
def test_history_and_system_prompt_are_hashed_as_sent(stored: str, asked: str) -> None:
    a = request_key(chat("And the next one?", history=[{"role": "user", "content": stored},
                                                        {"role": "assistant", "content": "ok"}]))
    b = request_key(chat("And the next one?", history=[{"role": "user", "content": asked},
                                                        {"role": "assistant", "content": "ok"}]))
    assert a.history_hash != b.history_hash and a.exact_key != b.exact_key
    assert context_hash(chat("q", system=stored)) != context_hash(chat("q", system=asked))


def test_nothing_is_normalized_not_even_line_ends() -> None:
    key = request_key(chat("line one\nline two")).exact_key
    for variant in ("line one\nline two ", " line one\nline two", "line one\n line two", "line one  \nline two",
                    "line one line two", "line one\n\nline two", "line one\r\nline two"):
        assert request_key(chat(variant)).exact_key != key, variant
    # a raw completion's trailing space changes its continuation: never one key with the prompt without it
    assert request_key(chat("The capital of France is")).exact_key != \
        request_key(chat("The capital of France is ")).exact_key


def test_the_key_version_is_in_every_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries keyed the old way (unversioned, NFKC) are never found: a plain ASCII question that both ways would
    hash alike gets another exact key, history hash and context hash than it had."""
    body = chat("What is the capital of France?")
    turns = [_turn(m) for m in body["messages"]]
    key = request_key(body)
    assert key.exact_key != _digest(turns)[:32]  # the unversioned hash of the same turns
    assert key.history_hash != _digest(["history", [turns[0], [{"role": "user"}, "string", "<last-user>"]]])[:32]
    old_context = _digest([[_turn(body["messages"][0])], [], {}])[:32]
    assert context_hash(body) != old_context
    context = context_hash(body)
    monkeypatch.setattr(keys, "KEY_VERSION", keys.KEY_VERSION + "-next")
    assert request_key(body).exact_key != key.exact_key and context_hash(body) != context


def test_the_embedding_alone_reads_the_normalized_text() -> None:
    embedding_text = keys.embedding_text
    assert embedding_text("Is 2³ a prime number?") == embedding_text("Is 23 a prime number?") == \
        "Is 23 a prime number?"  # so only the guards can tell these apart
    assert embedding_text(LOOP_INSIDE) == embedding_text(LOOP_AFTER) == normalize_text(LOOP_AFTER)
    assert embedding_text("x" * guards.MAX_CHARS) and embedding_text("x" * (guards.MAX_CHARS + 1)) == ""


# -- the guards ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "read"), [
    ("Is 2³ a prime number?", "Is 2^(3) a prime number?"),
    ("What is 10² in decimal?", "What is 10^(2) in decimal?"),
    ("Is x²³ + 1 > 0", "Is x^(23) + 1 > 0"),
    ("H₂O, CO₂", "H_(2)O, CO_(2)"),
    ("log₂8", "log_(2)8"),
    ("Convert ⅛ inch", "Convert (1⁄8) inch"),
    ("1⅛ cups", "1(1⁄8) cups"),
    ("Step ①②", "Step (1)(2)"),
    ("Ｐａｒｉｓ，　１２ km", "Paris, 12 km"),  # full-width letters and digits read as plain ones
    ("ﬁle  size\n of 5 MB ", "file size of 5 MB"),
])
def test_the_guards_read_superscripts_and_fractions_apart(text: str, read: str) -> None:
    assert guards.comparable(text) == read


@pytest.mark.parametrize(("query", "candidate", "reason"), [
    ("Is 23 a prime number?", "Is 2³ a prime number?", "numbers differ"),
    ("What is 102 in decimal?", "What is 10² in decimal?", "numbers differ"),
    ("Is 2⁴ a prime number?", "Is 2³ a prime number?", "numbers differ"),  # NFKC'd, then read raw: both "2"
    ("Add 11⁄8 cups of flour", "Add 1⅛ cups of flour", "numbers differ"),
    ("What is log28?", "What is log₂8?", "numbers differ"),
    ("What is Ｒｏｍｅ famous for?", "What is Paris famous for?", "entities differ"),  # full-width still read
    (LOOP_AFTER, LOOP_INSIDE, LAYOUT_DIFFERS),
    ("Run:\nif x:\n\ty()", "Run:\nif x:\n    y()", LAYOUT_DIFFERS),  # a tab is not four spaces
    ("x = 1\ny = 2\nprint(x)", "x = 1 y = 2 print(x)", LAYOUT_DIFFERS),
    ('Split "a\tb" on whitespace', 'Split "a b" on whitespace', QUOTES_DIFFER),  # one line, quoted: as sent
    ("What does `echo  hi` print?", "What does `echo hi` print?", QUOTES_DIFFER),
    ("Is 'a  b' == 'a b' in Python?", "Is 'a b' == 'a b' in Python?", QUOTES_DIFFER),
    ('What is "abc".upper()?', 'What is "abd".upper()?', QUOTES_DIFFER),
])
def test_the_guards_refuse_what_only_normalization_made_equal(query: str, candidate: str, reason: str) -> None:
    assert guards.check(query, candidate) == reason
    assert guards.check(candidate, query) == reason


@pytest.mark.parametrize(("query", "candidate"), [
    ("Is 2^3 a prime number?", "Is 2³ a prime number?"),
    ("Convert 1⁄8 inch to mm", "Convert ⅛ inch to mm"),
    ("What is Ｐａｒｉｓ famous for?", "What is Paris famous for?"),
    ("What is the capital of France?\n", "  What is the capital of  France?"),  # one line: its spacing is prose
    ("Fix this:\n```\nfor i in x:\n    f(i)\n```", "Fix this:\n\nfor i in x:\n    f(i)"),  # fences, blanks
    ("What does `ls -la` do?", "What does ls -la do?"),  # quoted on one side only, the same characters
    ("What does 'carpe diem' mean?", 'What does "carpe diem" mean?'),  # quoted either way
    ("I don't know what 'idempotent' means", "What does 'idempotent' mean? I don't know"),  # apostrophes
    ("Use `fs.ls` with the instance `fs`", "With the instance `fs`, use `fs.ls`"),  # reordered (GPTCache's pair)
])
def test_the_guards_pass_what_means_the_same(query: str, candidate: str) -> None:
    assert guards.check(query, candidate) is None


def test_a_text_the_marks_make_too_long_is_refused_not_half_read() -> None:
    text = "²" * guards.MAX_CHARS  # within the window as sent, "^(...)" past it as read
    assert len(guards.comparable(text)) > guards.MAX_CHARS
    assert guards.check(text, text) == guards.TOO_LONG


# -- end to end, through the cache -------------------------------------------------------------------------------

@pytest.mark.parametrize(("stored", "asked"), [*FOLDED_APART, *[(b, a) for a, b in FOLDED_APART]],
                         ids=[*IDS, *(f"{i}-reversed" for i in IDS)])
def test_neither_layer_serves_one_for_the_other(cache: SemanticCache, stored: str, asked: str) -> None:
    body = chat(stored)
    assert cache.store(scope(body), body, "the answer to the stored one", {}) is not None
    assert isinstance(cache.lookup(scope(body), body), Hit)  # the repeat is served
    result = cache.lookup(scope(chat(asked)), chat(asked))
    assert result.status == "miss", result
    # the two embed identically: the guards, not the threshold, refused it
    assert result.best_similarity is not None and result.best_similarity > 0.999
    assert result.reason.startswith("refused near miss: "), result.reason
    assert any(r in result.reason for r in ("numbers differ", LAYOUT_DIFFERS, QUOTES_DIFFER)), result.reason


def test_a_spacing_variant_of_prose_is_served_by_meaning(cache: SemanticCache) -> None:
    body = chat("What is the capital of France?")
    cache.store(scope(body), body, "Paris", {})
    variant = chat("What is the  capital of France?\n")
    hit = cache.lookup(scope(variant), variant)
    assert isinstance(hit, Hit) and hit.kind == "semantic" and hit.response == "Paris"


def test_the_meaning_check_reads_what_the_guards_read(cache: SemanticCache, monkeypatch: pytest.MonkeyPatch) -> None:
    body = chat("What is x² + 1 when x is 3?")
    cache.store(scope(body), body, "10", {})
    read: list[tuple[str, str]] = []
    monkeypatch.setattr(cache.meaning, "accepts",
                        lambda cached, new, scope="", owner="": read.append((cached, new)) or True)
    asked = chat("What is x^2 + 1 when x is 3?")
    hit = cache.lookup(scope(asked), asked, policy=TenantPolicy(meaning_check=True))
    assert isinstance(hit, Hit) and hit.kind == "semantic", hit
    assert read == [("What is x^(2) + 1 when x is 3?", "What is x^2 + 1 when x is 3?")]


def test_entries_keyed_under_another_version_are_never_found(cache: SemanticCache,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    body = chat("What is the capital of France?")
    current = keys.KEY_VERSION
    monkeypatch.setattr(keys, "KEY_VERSION", "k-old")
    assert cache.store(scope(body), body, "stored the old way", {}) is not None
    monkeypatch.setattr(keys, "KEY_VERSION", current)
    result = cache.lookup(scope(body), body)
    assert result.status == "miss" and result.reason == "no entry", result  # neither exact nor by meaning
