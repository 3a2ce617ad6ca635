"""What a regular expression would cost a grammar compiler, read in one pass (wire/schema_costs.py says why).

`pattern_weight`: a pattern's atoms, each times the counts of the repetitions around it, as llguidance expands them
(a count after a count, spaces inside a count and the `x` flag's whitespace read as it reads them);
`pattern_min_chars`: the fewest characters a match holds. Neither decides whether a pattern is valid: the compiler
says so, as before.

Both read what is no pattern as Python's `re` (sre_parse) does: where the x flag is on, whitespace and a `#` comment
to the line's end; and a `(?#...)` comment, which ends at its first `)` not escaped by a backslash (`(?#a)b)` is the
comment `a`, then `b`, then a stray `)`), whatever its text holds (`(`, `[`, `|`, counts). The weight counted both
as pattern (`(?x)a # b{20000}` weighed 20,001 and was refused); the fewest characters read a comment's `(`, `[` or
escaped `)` as syntax. One reading differs from re's on purpose: an x-flag comment ends at the first newline,
escaped or not, as llguidance ends it (re reads a backslash and a newline as one escape, inside the comment); the
compiler's reading is what a pattern costs. llguidance refuses `(?#` itself ("unrecognized flag"); reading it as re
does only keeps the weight and the fewest characters from reading its text.
"""

from __future__ import annotations

import re
from typing import Any

MAX_PATTERN_WEIGHT = 10_000  # a pattern's atoms, each times the repetition counts around it
_BRACED_ESCAPES = frozenset("pPux")  # `\p{L}`, `\u{1F600}`, `\x{41}`: the braces are the escape's, not a count


def pattern_limit(pattern: str) -> int:
    """The most `pattern` may weigh: MAX_PATTERN_WEIGHT, or its own length where that is more (a long pattern that
    repeats nothing costs what a `const` of its length does, which the schema's size bounds)."""
    return max(MAX_PATTERN_WEIGHT, len(pattern))


def pattern_weight(pattern: str) -> int:
    """The weight of an ECMA-262 pattern (see the module), capped just past its `pattern_limit`. One pass."""
    cap = pattern_limit(pattern) + 1
    # a frame per open group: [weight so far, whether it repeats without bound inside, whether the x flag is on]
    frames: list[list[Any]] = [[0, False, 0]]
    last = 0  # the weight of the last atom or group, which a quantifier multiplies
    last_unbounded = False
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        quantified = False
        if frames[-1][2] and (c.isspace() or c == "#"):  # the x flag: no atom (`(a{1000}) {1000}` repeats the group)
            i = _after(pattern, i, "\n") if c == "#" else i + 1
            continue
        if pattern.startswith("(?#", i):  # a comment: no atom, and a quantifier after it repeats the last one
            i = _comment_end(pattern, i)
            continue
        if c == "\\":
            i += 2
            if pattern[i - 1:i] in _BRACED_ESCAPES and pattern[i:i + 1] == "{":
                i = _after(pattern, i, "}")
            last, last_unbounded = 1, False
        elif c == "[":
            i = _class_end(pattern, i)
            last, last_unbounded = 1, False
        elif c == "(":  # its opening weighs nothing (`(?:`, `(?P<name>`, flags), and flags alone open no group
            verbose, _, flags_only, i = _group_opening(pattern, i, frames[-1][2])
            if flags_only:
                frames[-1][2] = verbose
            else:
                frames.append([0, False, verbose])
            continue
        elif c == ")" and len(frames) > 1:
            last, last_unbounded, _ = frames.pop()
            i += 1
        elif c == "|":
            i += 1
            continue  # the alternatives' weights add up in their frame
        elif c in "*+?":
            quantified, count = True, 1
            unbounded = c != "?"
            i += 1
        elif c == "{" and (counted := _count(pattern, i)) is not None:
            quantified, (count, unbounded, i, _) = True, counted
        else:
            last, last_unbounded = int(c not in "^$"), False  # an anchor matches no character
            i += 1
        frame = frames[-1]
        if quantified:
            if pattern[i:i + 1] in ("?", "+"):  # lazy or possessive: the same repetition
                i += 1
            factor = count * count if last_unbounded and count > 1 else count
            frame[0] = min(frame[0] - last + last * factor, cap)  # the atom was added once; now `factor` times
            frame[1] = frame[1] or unbounded or last_unbounded
            # what it repeated, repeated: a quantifier after it repeats that again (`a{1000}{1000}` is a million a's
            # to llguidance, which held the step loop 0.83 s and then failed)
            last, last_unbounded = min(last * factor, cap), unbounded or last_unbounded
        else:
            frame[0] = min(frame[0] + last, cap)
            frame[1] = frame[1] or last_unbounded
    while len(frames) > 1:  # an unclosed group: the compiler refuses it; weigh what is there
        weight = frames.pop()[0]
        frames[-1][0] = min(frames[-1][0] + weight, cap)
    return frames[0][0]


def _after(pattern: str, i: int, close: str) -> int:
    """The index after the first `close` from `i` (the end when there is none)."""
    end = pattern.find(close, i)
    return len(pattern) if end < 0 else end + 1


def _comment_end(pattern: str, i: int) -> int:
    """The index after the `(?#...)` comment opening at `i`: after its first `)` that no backslash escapes, as
    sre_parse reads it (the end when there is none, which re refuses)."""
    i, n = i + 3, len(pattern)
    while i < n:
        if pattern[i] == "\\":
            i += 2
        elif pattern[i] == ")":
            return i + 1
        else:
            i += 1
    return n


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at `i` (nested classes, as llguidance's syntax has them)."""
    depth, i = 0, i
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


# a counted repetition as `_count` reads it: from its brace to the first `}`, digits and whitespace (str.split's,
# which `\s` is), at most one comma, a digit before it. What can be in one holds no `{`, so the reads from each brace
# of a pattern cover separate stretches of it: linear (a scan to the next `}` from each brace, copying what was
# between, was quadratic: a 32 KB pattern of `{ ` held the event loop 6 s)
_COUNTED = re.compile(r"\{\s*+([0-9][0-9\s]*+)(?:(,)([0-9\s]*+))?\}")


def _count(pattern: str, i: int) -> tuple[int, bool, int, int] | None:
    """The counted repetition `{m}`, `{m,}` or `{m,n}` at `i`: (its count, whether it is unbounded, the index after
    it, its least count m); None where the brace is a literal. Spaces inside are the count's (`a{ 1000000 }` is a
    count to llguidance: 0.28 s, then a failure), and those between its digits are dropped (`{1 0}` reads as 10)."""
    counted = _COUNTED.match(pattern, i)
    if counted is None:
        return None
    low, comma, high = ("".join(g.split()) if g else "" for g in counted.group(1, 2, 3))
    # digits past ten are past any bound: never turned into a number that long
    m = int(low[:10]) if len(low) <= 10 else MAX_PATTERN_WEIGHT + 1
    k = (int(high[:10]) if len(high) <= 10 else MAX_PATTERN_WEIGHT + 1) if high else 0
    unbounded = bool(comma) and not high
    return max(m + unbounded, k, 1), unbounded, counted.end(), m


def pattern_min_chars(pattern: str, most: int) -> int:
    """The fewest characters a string matching `pattern` holds (a lower bound; capped just past `most`).

    A group's opening is no character: `(?:`, `(?<name>`, `(?P<name>`, and flags, `(?i)` or `(?x:`; a lookaround
    (`(?=...)`, `(?<!...)`) holds none. Where the x flag is on (`(?x)` to its group's end, `(?x:...)` within), as
    llguidance reads it, whitespace and `#` comments to the line's end are no characters: `(?x) a b c` holds 3."""
    cap = most + 1
    # per open group: [this alternative's count, the fewest of those closed, the x flag, whether it is a lookaround]
    frames: list[list[int]] = [[0, cap, 0, 0]]
    last, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        count = None
        if frames[-1][2] and (c.isspace() or c == "#"):  # the x flag: no atom (a quantifier after still repeats last)
            i = _after(pattern, i, "\n") if c == "#" else i + 1
            continue
        if pattern.startswith("(?#", i):  # a comment, as the x flag's: no character, `last` still the one before
            i = _comment_end(pattern, i)
            continue
        if c == "\\":
            i += 2
            if pattern[i - 1:i] in _BRACED_ESCAPES and pattern[i:i + 1] == "{":
                i = _after(pattern, i, "}")
            last = int(pattern[i - 1:i] not in _ZERO_WIDTH_ESCAPES)
        elif c == "[":
            i, last = _class_end(pattern, i), 1
        elif c == "(":
            verbose, lookaround, flags_only, i = _group_opening(pattern, i, frames[-1][2])
            last = 0
            if flags_only:  # `(?x)`: the flags hold to the end of the group it is in
                frames[-1][2] = verbose
                continue
            frames.append([0, cap, verbose, lookaround])
            continue
        elif c == ")" and len(frames) > 1:
            alt, fewest, _, lookaround = frames.pop()
            last = 0 if lookaround else min(alt, fewest)
            i += 1
        elif c == "|":
            frame = frames[-1]
            frame[1], frame[0] = min(frame[1], frame[0]), 0
            i += 1
            continue
        elif c in "*?":
            count, i = 0, i + 1
        elif c == "+":
            count, i = 1, i + 1
        elif c == "{" and (counted := _count(pattern, i)) is not None:
            count, i = counted[3], counted[2]
        else:
            last, i = int(c not in "^$"), i + 1
        frame = frames[-1]
        if count is not None:
            if pattern[i:i + 1] in ("?", "+"):
                i += 1
            frame[0] = min(frame[0] - last + last * count, cap)
            last = 0
        else:
            frame[0] = min(frame[0] + last, cap)
    while len(frames) > 1:
        alt, fewest, _, lookaround = frames.pop()
        frames[-1][0] = min(frames[-1][0] + (0 if lookaround else min(alt, fewest)), cap)
    return min(frames[0][0], frames[0][1])


_ZERO_WIDTH_ESCAPES = frozenset("bBAz")  # word boundaries, and the text's start and end (`\A`, `\z`)
# a group's opening past "(": flags on and off then ":" or ")" (`?:` has none), a name, or a lookaround
_GROUP_FLAGS = re.compile(r"\?([A-Za-z]*)(?:-([A-Za-z]*))?([:)])")
_GROUP_NAME = re.compile(r"\?P?<[\w.\[\]]*+>")  # a run of name characters: each read once
_LOOKAROUND = re.compile(r"\?(?:[=!]|<[=!])")


def _group_opening(pattern: str, i: int, verbose: int) -> tuple[int, int, bool, int]:
    """The group opening at `i` (a "("): (whether the x flag is on past it, whether it is a lookaround, whether it
    sets flags only (`(?x)`: no group), the index past it). The x flag is `verbose` unless the opening turns it on or
    off. An opening read as none of these (`(?P=name)`) is read as a lookaround: it counts no character, a lower
    bound still. A `(?#` comment is no group: the callers skip it (`_comment_end`) before they come here."""
    if pattern[i + 1:i + 2] != "?":
        return verbose, 0, False, i + 1
    if (flags := _GROUP_FLAGS.match(pattern, i + 1)) is not None:
        on, off, end = flags.group(1), flags.group(2) or "", flags.group(3)
        verbose = 0 if "x" in off else 1 if "x" in on else verbose
        return verbose, 0, end == ")", flags.end()
    if (name := _GROUP_NAME.match(pattern, i + 1)) is not None:
        return verbose, 0, False, name.end()
    if (around := _LOOKAROUND.match(pattern, i + 1)) is not None:
        return verbose, 1, False, around.end()
    return verbose, 1, False, i + 2
