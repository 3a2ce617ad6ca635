"""The units a prompt sizes text in, for the near-miss guards (cache/guards.py): "in 500 words" is not "in 500
sentences".

What an LLM is asked to write, or asked about, is measured in these units (words, sentences, paragraphs, pages,
lines, characters, tokens, bullet points, letters, syllables, verses, sections, chapters, slides), so two prompts
that differ only in one ask for different answers although they embed as near twins. The guards compare the units
`size_units` finds on both sides alongside their measurement units (km, kg...).

It is its own module because it is its own pass: a tokenizer and a look-ahead over words, with a vocabulary of its
own, which the guards call once per text. The number words ("five", "dozen"...) stay the guards' (they read them as
numbers too) and come in as an argument, so this module imports nothing of the guards.

The vocabulary was written for the gateway from what prompts ask of a model (length limits, summaries, lists,
poems, slides), before any failure of the held-out sets (bench/near_miss_sets.py) was read, and without reading
that file's unit lexicon. The units are common words ("in other words", "command line", "a web page", "the
point"), so one counts only where a count comes just before it: a number (digits or a number word, or
"one"/"single"), "how many", "the number of", "count the", with at most two words between ("3 short paragraphs",
"a 500-word essay", "5 key bullet points"), or where a "count"/"limit"/"length" follows it ("word count", "token
limit"). The first such unit after a count is counted.
"""

from __future__ import annotations

import re
from collections.abc import Container

_TEXT_SIZE_UNITS = {
    "word": "word words", "sentence": "sentence sentences", "paragraph": "paragraph paragraphs para paras",
    "page": "page pages", "line": "line lines", "character": "character characters char chars",
    "token": "token tokens", "point": "point points bullet bullets", "letter": "letter letters",
    "syllable": "syllable syllables", "verse": "verse verses stanza stanzas", "section": "section sections",
    "chapter": "chapter chapters", "slide": "slide slides",
}
_SIZE_WORD = {w: f"text {canon}" for canon, words in _TEXT_SIZE_UNITS.items() for w in words.split()}
_COUNT_WORDS = frozenset({"one", "single", "count", "counts", "counting"})  # besides the number words
_SIZE_AFTER = frozenset({"count", "counts", "limit", "limits", "length", "lengths"})  # "word count", "token limit"
_SIZE_GAP = 2  # words between a count and its unit
# Possessive quantifiers: linear in the text.
_SIZE_TOKEN = re.compile(r"\d++(?:[.,]\d++)*+|[a-z]++|[.;:!?()\[\]{}\n]")  # numbers, words, and what ends a phrase


def size_units(text: str, number_words: Container[str]) -> list[str]:
    """The units `text` sizes text in (`_TEXT_SIZE_UNITS`), each counted once where a count (digits, a word of
    `number_words`, "one"/"single"...) comes before it or a "count"/"limit" after it: "write 3 short paragraphs" ->
    ["text paragraph"], "in other words" -> [].

    One pass over the words; each count looks at most `_SIZE_GAP` + 1 words ahead, so the work is linear."""
    tokens = _SIZE_TOKEN.findall(text.lower())
    found: set[int] = set()  # the positions of the units counted
    for i, token in enumerate(tokens):
        if token in _SIZE_WORD and i + 1 < len(tokens) and tokens[i + 1] in _SIZE_AFTER:
            found.add(i)
            continue
        number_of = token == "number" and i + 1 < len(tokens) and tokens[i + 1] == "of"
        if not (token[0].isdigit() or token in number_words or token in _COUNT_WORDS or number_of
                or (token == "many" and i and tokens[i - 1] == "how")):
            continue
        for j in range(i + 1 + number_of, min(i + 2 + number_of + _SIZE_GAP, len(tokens))):
            if tokens[j] in _SIZE_WORD:
                found.add(j)
                break
            if tokens[j][0].isdigit() or not tokens[j].isalpha() or tokens[j] == "of":
                break  # another count, the phrase ended, or "one of the ...": a part, not a size
    return [_SIZE_WORD[tokens[i]] for i in sorted(found)]


def size_mentions(text: str) -> frozenset[str]:
    """Every unit of `_TEXT_SIZE_UNITS` that `text` names, counted or not: "avoid complex words" -> {"text word"}.

    For the guards' swap rule (cache/guards.py `check`): a text that names one of these units where the other names
    a different one ("a list of words" / "a list of sentences", "in bullet points" / "in paragraphs") asks for
    another size of text, counted or not. An uncounted mention alone ("in other words" on one side only) changes
    nothing, so `size_units`' count is still what the guards compare as a quantity."""
    return frozenset(_SIZE_WORD[t] for t in _SIZE_TOKEN.findall(text.lower()) if t in _SIZE_WORD)
