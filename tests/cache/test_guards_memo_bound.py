"""What the near-miss guards remember of a text is bounded by what they read (cache/guards.py `comparable`).

`comparable`'s results are memoized (MEMO_PER_OWNER texts a tenant) in each gateway process, and what it read was kept
whole, however long: NFKC lengthens a character up to 18 times (U+FDFA, one Arabic ligature, reads 18 letters), so
2,048 of them were remembered as 36,847 characters, 76 KB, though the guards refuse such a text unread (too long as
read). The semantic cache hands the guards only turns whose NFKC form is at most 2,048 characters, where the marks the
guards add ("a₂" reads "a_(2)") lengthen a turn 2.5 times at most (5 KB an entry); this holds the function itself to
the bound."""

from __future__ import annotations

import tracemalloc

from cache import guards
from cache.guard_memos import MEMO_PER_OWNER

LIGATURE = "\ufdfa"  # NFKC: 18 characters
TEXTS = 100  # within one owner's memo (MEMO_PER_OWNER): each read is kept


def test_a_text_that_reads_long_is_remembered_at_the_guards_bound() -> None:
    texts = [LIGATURE * (guards.MAX_CHARS - 8) + f"{i:08d}" for i in range(TEXTS)]  # each new: a memo entry each
    assert TEXTS <= MEMO_PER_OWNER
    guards._MEMO.clear()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reads = [guards.comparable(text, "acme") for text in texts]
        held = (tracemalloc.get_traced_memory()[0] - before) / TEXTS
    finally:
        tracemalloc.stop()
        guards._MEMO.clear()
    # the texts themselves are the caller's (4 KB each, UCS-2); what the memo adds for one stays near a text's size
    assert held < 12 * 1024, f"{held / 1024:.0f} KB remembered for each text"
    assert all(len(read) == guards.MAX_CHARS + 1 for read in reads)  # too long as read: cut, refused as before
    assert guards.check(texts[0], texts[1]) == guards.TOO_LONG


def test_a_text_too_long_as_sent_is_not_remembered() -> None:
    guards._MEMO.clear()
    text = "a" * (guards.MAX_CHARS + 50)
    read = guards.comparable(text, "acme")
    assert len(read) == guards.MAX_CHARS + 1
    assert guards._MEMO.reads.get("acme", text) is None and guards._MEMO.reads.get("acme", read) is None
