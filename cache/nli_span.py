"""The place where two questions differ, cut out for the meaning check to read alone (issue 21).

Two questions that differ in one place ("how do I play a game" / "how do I display a game", "the old version" / "the
young version") are what the near-miss edits look like, and what the meaning check reads worst: its NLI model sees
two almost identical texts, and the overlap pulls its score towards "same" whatever the changed word is (the known
lexical-overlap bias of NLI models). On the development set (bench/meaning_dev_sets.py, questions of the training
side of the split; the guards before session 46) the check accepted 59 such one-place edits of 929 antonym and unit
edits, all at scores where paraphrases also sit (-1.35 to 0), read either way round: the margin cannot separate
them (medians -0.87 and -0.75; at -1.0 it still let 41 through and refused a fifth of those paraphrases), nor can
the pair's order (the check already takes the smaller of the two directions).

Read alone, with one word of context on each side ("the old version" / "the young version"), the changed place
carries the pair's whole difference, and the model scores it on its own. `minimal_pair` finds that place: the
words the two texts share at the start and at the end are dropped, and if what is left on each side is at most
`MAX_CHANGED` words, the pair is a minimal pair and the place, with `CONTEXT` words either side, is returned as a
pair of short texts. Anything else (paraphrases that reword more than a phrase, reorderings) is read whole only.
No word list: any word, in any place.

Words are compared case-folded; a word is a run of letters and digits (with inner apostrophes), and every other
non-space character is a word of its own, so a changed punctuation mark is a change too. The texts returned are
the words joined by single spaces (how the window's margin was calibrated: cache/meaning_check.py).
"""

from __future__ import annotations

import re

MAX_CHANGED = 3  # words changed on either side, at most, for a pair to be a minimal pair
CONTEXT = 1  # words of shared context kept on each side of the change
_WORDS = re.compile(r"\w+(?:['’]\w+)*+|[^\w\s]")


def minimal_pair(a: str, b: str, context: int = CONTEXT) -> tuple[str, str] | None:
    """(a's changed place, b's changed place), each with `context` shared words around it, when `a` and `b` differ in
    one place of at most `MAX_CHANGED` words on each side; None when they differ more, or not at all (case aside)."""
    x, y = _WORDS.findall(a), _WORDS.findall(b)
    xl, yl = [w.casefold() for w in x], [w.casefold() for w in y]
    shortest = min(len(x), len(y))
    start = 0
    while start < shortest and xl[start] == yl[start]:
        start += 1
    end = 0  # shared words at the end, not overlapping the shared start
    while end < shortest - start and xl[-1 - end] == yl[-1 - end]:
        end += 1
    changed_x, changed_y = len(x) - start - end, len(y) - start - end
    if max(changed_x, changed_y) == 0 or max(changed_x, changed_y) > MAX_CHANGED:
        return None
    lo = max(0, start - context)
    return " ".join(x[lo:len(x) - end + context]), " ".join(y[lo:len(y) - end + context])
