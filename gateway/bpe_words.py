"""Token counts of ASCII text for a byte-level BPE tokenizer (GPT-2's family; SmolLM2's), word by word, with the
words' counts remembered: the same count as `tokenizers`' `encode`, at a tenth of its cost on a short prompt.

Such a tokenizer cuts a text into words with one regular expression (GPT-2's: contractions, letters with an
optional leading space, digits, other symbols, runs of whitespace), maps each word's bytes to printable characters
and runs BPE on each word alone, so a text's count is the sum of its words' counts. `encode` builds a whole
`Encoding` (tokens, offsets converted to characters, masks) to be asked for its length: ~50-130 µs for a 100-character
prompt, the largest single cost of a new request in `bench/gateway_profile.py`. Here a word seen before costs a
dictionary lookup and a new one a call of the BPE model alone.

Only ASCII text is counted here, where GPT-2's character classes are plain (letters A-Z and a-z, digits 0-9,
whitespace tab to carriage return and space) and Python's `re` cuts exactly where the tokenizer's regex engine
does; any other text goes to `encode`. Only a tokenizer with exactly that pre-tokenizer, no normalizer and a plain
BPE model qualifies (`for_tokenizer`), and the byte-to-character map is read from the tokenizer itself.
tests/gateway/test_bpe_words.py checks the counts equal `encode`'s on ShareGPT and on generated ASCII text.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from tokenizers import Tokenizer

_WS = "\\t\\n\\x0b\\x0c\\r "  # ASCII whitespace as the tokenizer's \s sees it (0x1c-0x1f are not)
_WORDS = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+")
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
RECENT_WORDS = 65536  # words whose counts are remembered, oldest dropped first
LONGEST_REMEMBERED = 64  # characters: a longer word is counted each time (a tenant cannot fill memory with them)


class ByteLevelWords:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._model = tokenizer.model
        pre = tokenizer.pre_tokenizer
        assert pre is not None
        # each ASCII byte's printable stand-in, as the tokenizer maps it (a word of one byte is never cut further)
        self._bytes = {b: pre.pre_tokenize_str(chr(b))[0][0] for b in range(128)}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ByteLevelWords | None:
        """The word counter for `tokenizer`, or None when its counts cannot be made this way."""
        spec: dict[str, Any] = json.loads(tokenizer.to_str())
        pre = spec.get("pre_tokenizer") or {}
        model = spec.get("model") or {}
        if (spec.get("normalizer") is not None or {k: pre.get(k) for k in GPT2_PRE_TOKENIZER} != GPT2_PRE_TOKENIZER
                or model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix")
                or model.get("end_of_word_suffix")):
            return None
        return cls(tokenizer)

    def count(self, text: str) -> int:
        """Tokens of an ASCII `text` with no added token in it (the caller checks `text.isascii()` and cuts the
        text at the tokenizer's added tokens first, as TokenCounter does for a prompt)."""
        total = 0
        counts = self._counts
        for word in _WORDS.findall(text):
            n = counts.get(word)
            if n is None:
                n = len(self._model.tokenize(word.translate(self._bytes)))
                if len(word) <= LONGEST_REMEMBERED:
                    with self._lock:  # worker threads count too
                        counts[word] = n
                        if len(counts) > RECENT_WORDS:
                            del counts[next(iter(counts))]
            total += n
        return total
