"""The near-miss guards' reading of a text as sent: its layout (line breaks and indentation) and what it quotes.

These two guards (cache/guards.py `check`) read the turns as sent, not as `guards.comparable` reads them: NFKC and
collapsed whitespace would make `print("a  b")` quote what `print("a b")` does, and a snippet whose `print(x)` moved
out of its loop read like the one where it is inside. They share nothing with the rest of the guards' reading
(numbers, units, entities, order), which works on the comparable form, so they live apart from it.

Both are linear in the text: `layout` splits it once, and `quoted` reads each closed quote once and searches for a
missing closing quote once per line.
"""

from __future__ import annotations

import re

_FENCES = ("```", "~~~")  # a Markdown code fence line: whether a snippet is fenced does not change what it does
# Where a quote may open: ", “, `, or ' not inside a word (not the apostrophes of "don't ... isn't"); its closing
# quote, on the same line.
_QUOTE_OPENS = re.compile(r"[\"“`]|(?<![\w'])'")
_QUOTE_CLOSES = {'"': '"', "“": "”", "`": "`", "'": "'"}


def layout(text: str) -> tuple[str, ...]:
    """The indentation of each line of `text` (as sent, ends stripped) but blank lines and Markdown code fences
    (markup, not content); () for a text of one line.

    Two texts of several lines agree on it only with the same line breaks and the same indentation, character for
    character (a tab is not four spaces): in code, either changes what runs."""
    lines = text.replace("\r\n", "\n").strip().split("\n")
    if len(lines) == 1:
        return ()
    return tuple(line[:len(line) - len(line.lstrip())] for line in lines
                 if line.strip() and not line.lstrip().startswith(_FENCES))


def quoted(text: str) -> tuple[str, ...]:
    """What `text` (as sent) quotes on one line, in order, empty quotes left out: `print("a  b")` -> ("a  b",).

    Linear: a closed quote's text is read once, and a closing quote missing from the rest of a line is searched for
    once per line (a pattern that ran on to the line's end from every unclosed quote was quadratic)."""
    out: list[str] = []
    pos, line_end = 0, -1
    missing: dict[str, int] = {}  # closing quote -> the end of the line it is known missing from
    while (opening := _QUOTE_OPENS.search(text, pos)) is not None:
        start = opening.start()
        if start > line_end:
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end
        close = _QUOTE_CLOSES[opening.group()]
        pos = start + 1
        if missing.get(close) == line_end:
            continue
        end = text.find(close, pos, line_end)
        if end < 0:
            missing[close] = line_end
            continue
        if close == "'" and end + 1 < len(text) and (text[end + 1].isalnum() or text[end + 1] == "_"):
            continue  # 'it's: an apostrophe, not a closing quote
        if end > pos:
            out.append(text[pos:end])
        pos = end + 1
    return tuple(out)


def quotes_disagree(a: str, b: str) -> bool:
    """A quote of either text (as sent) missing, character for character, from the other. A quote the other text
    has unquoted agrees ("what is `ls -la`" / "what is ls -la"), and so do quotes in another order: paraphrases
    reorder the names they quote (27 of GPTCache's 999 pairs); a swap of roles is the anchors' to see."""
    qa, qb = quoted(a), quoted(b)
    return qa != qb and (any(q not in b for q in set(qa)) or any(q not in a for q in set(qb)))
