"""`token_bound`: what an embeddings request reserves before its texts are counted (gateway/embeddings_service.py)
must never be below MiniLM's real count, on any text a tenant can send. cache/embedder.py states why; this checks
the facts the argument rests on (every code point's normalized length, through the tokenizer's own normalizer) and
the bound itself on hostile texts."""

from __future__ import annotations

import random

import pytest

from cache import Embedder
from cache.embedder import MAX_EXPANSION, SPECIAL_TOKENS, token_bound


def test_no_code_point_normalizes_to_more_than_max_expansion_characters(embedder: Embedder) -> None:
    normalize = embedder._load().tokenizer.backend_tokenizer.normalizer.normalize_str
    widest = {0: 0, 1: 0}  # ASCII, the rest
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        n = len(normalize(chr(cp)).replace(" ", ""))
        widest[cp >= 0x80] = max(widest[cp >= 0x80], n)
    assert widest == {0: 1, 1: MAX_EXPANSION}


HOSTILE = [
    "hello world", "a", "!", "!" * 8192, "a " * 4096, "a.b," * 2048, "x" * 8192, "İ" * 500, "ß" * 300,
    "한국어 " * 100, "한 " * 100, "한" * 90, "안녕하세요" * 20,  # Hangul: three pieces a syllable
    "গো" * 150, "\u0b4b" * 100,  # Indic two-part vowel signs
    "e\u0301" * 200, "a" + "\u0301" * 1000, "\u0301" * 300,  # combining marks, alone and stacked
    "中文字符" * 100, "日本語のテキスト" * 40, "𠀀𠀁" * 100,  # CJK ideographs (each its own word), astral ones
    "😀" * 300, "👨\u200d👩\u200d👧\u200d👦" * 60, "🇫🇷" * 100, "\u200b" * 500, "\x00\x01\x7f" * 100,
    "𝄞" * 100, "\U0001d1bc" * 100, "ﬁ" * 100, "Ⅻ" * 100, "①" * 100, "\ufffd" * 100,
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_the_bound_is_never_below_the_count(embedder: Embedder, text: str) -> None:
    assert embedder.num_tokens(text) <= token_bound(text)


def test_random_texts_of_the_widest_characters(embedder: Embedder) -> None:
    normalize = embedder._load().tokenizer.backend_tokenizer.normalizer.normalize_str
    wide = [chr(cp) for cp in [*range(0xAC00, 0xAC00 + 400), *range(0x980, 0xA00), *range(0x1D1B0, 0x1D1D0)]
            if len(normalize(chr(cp))) > 1]
    pool = wide + list("ab .!") + ["\u0301", "中", "😀"]
    rng = random.Random(7)
    for _ in range(200):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 120)))
        assert embedder.num_tokens(text) <= token_bound(text), text
    # characters + 2 would not be a bound: a Hangul syllable is three pieces (its jamo), where it has fewer than 100
    assert embedder.num_tokens("안녕하세요") == 14 > len("안녕하세요") + SPECIAL_TOKENS
    assert token_bound("hello world") == 13 and token_bound("é") == 3 + SPECIAL_TOKENS
