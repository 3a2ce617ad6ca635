"""The near-miss guards' memos are each tenant's own (cache/guard_memos.py, as assets/owner_memo.py has the vector and
meaning-check memos): one memo of 8,192 texts keyed by the text alone let one tenant learn by timing whether another's
text was read lately (1,550 µs against 1 µs at 2,000 characters) and let one tenant's flood evict everyone's texts.
Driven through `candidates.screen`, as the semantic cache calls it, counting the guards' own work: `_marked` runs once
for each text not yet NFKC read (`comparable`), `_expansions` once for each text whose features are read (`extract`)."""

from __future__ import annotations

from collections import Counter

import pytest

from cache import guards
from cache.candidates import screen
from cache.store import Entry

QUERY = "Is 2³ bigger than 10² in NASA's units?"  # not NFKC: `comparable` marks it (one `_marked` call a read)
CACHED = "Is 2³ larger than 10² in NASA units?"


def _entry(text: str) -> Entry:
    return Entry(entry_id="e1", scope_id="s", tenant="t", data_version="1", model_version="m", exact_key="k",
                 partition="p", semantic_text=text, response="yes")


def _screen(query: str, tenant: str, user: str | None = None, cached: str = CACHED) -> None:
    entry = _entry(cached)
    screen([("e1", 0.99)], query, threshold=0.9, floor=0.9, fallback_margin=0.02, meaning_check=False,
           tenant=tenant, fetch=lambda entry_id: entry, checked=lambda c: (c[0], ""), refused=Counter(),
           **({} if user is None else {"user": user}))


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the guards read a text (`_marked`) and extract its features (`_expansions`)."""
    counts: Counter[str] = Counter()
    marked, expansions = guards._marked, guards._expansions

    def counting_marked(text: str) -> str:
        counts["read"] += 1
        return marked(text)

    def counting_expansions(text: str) -> frozenset[tuple[str, str]]:
        counts["extract"] += 1
        return expansions(text)

    monkeypatch.setattr(guards, "_marked", counting_marked)
    monkeypatch.setattr(guards, "_expansions", counting_expansions)
    return counts


def test_a_text_guarded_for_one_tenant_is_no_memo_hit_for_another(work: Counter[str]) -> None:
    _screen(QUERY + " (a)", "tenant-a", cached=CACHED + " (a)")
    assert work == {"read": 2, "extract": 2}  # both texts read for A
    _screen(QUERY + " (a)", "tenant-a", cached=CACHED + " (a)")
    assert work == {"read": 2, "extract": 2}  # A's memo
    _screen(QUERY + " (a)", "tenant-b", cached=CACHED + " (a)")
    assert work == {"read": 4, "extract": 4}  # B reads them itself: nothing of A's is served to it (0 before)


def test_an_end_user_reads_no_text_another_end_user_left() -> None:
    seen: list[str] = []
    real = guards._expansions
    guards._expansions = lambda text: seen.append(text) or real(text)  # type: ignore[assignment]
    try:
        _screen(QUERY + " (u)", "tenant-u", user="alice", cached=CACHED + " (u)")
        _screen(QUERY + " (u)", "tenant-u", user="bob", cached=CACHED + " (u)")
    finally:
        guards._expansions = real  # type: ignore[assignment]
    assert len(seen) == 4


def test_another_tenants_flood_does_not_evict_a_tenants_texts(work: Counter[str]) -> None:
    _screen(QUERY + " (f)", "tenant-a", cached=CACHED + " (f)")
    assert work == {"read": 2, "extract": 2}
    for i in range(9000):  # past every bound the memos had (8,192 texts, shared)
        _screen(f"flood {i}", "tenant-b")
    work.clear()
    _screen(QUERY + " (f)", "tenant-a", cached=CACHED + " (f)")
    assert work == {}  # both of A's texts still remembered (both read again before)


def test_one_busy_tenants_hot_texts_are_all_remembered(work: Counter[str]) -> None:
    """A tenant's 400 texts asked in turn: each read once. Held to 8,192 / 64 = 128 texts a tenant, an LRU cycled past
    its size remembered none of them (read at every lookup, ~200 µs a check against ~3 µs)."""
    texts = [f"Is {i}² bigger than 10² in NASA's units?" for i in range(400)]  # not NFKC: read (`_marked`)
    for _ in range(2):
        for text in texts:
            _screen(text, "tenant-busy", cached=CACHED + " (busy)")
    assert work == {"read": len(texts) + 1, "extract": len(texts) + 1}  # each text and the cached one, once
