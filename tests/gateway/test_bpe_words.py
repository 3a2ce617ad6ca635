"""Word-by-word counts (gateway/bpe_words.py) equal `tokenizers`' own on SmolLM2's tokenizer: on every ASCII turn of
the first 3,000 ShareGPT conversations (whole, and cut at random places), on generated text made of every ASCII
character and of the pieces GPT-2's expression treats specially (contractions, whitespace runs before a word,
digits), and through TokenCounter for prompts. Tokenizers of another kind are left to `encode`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from assets.datasets import sharegpt_conversations
from gateway.bpe_words import LONGEST_REMEMBERED, ByteLevelWords
from gateway.token_counter import TokenCounter, _added_token_cut
from tests.conftest import MODELS_DIR

TRICKY = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n",
          "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f", "a", "Ab", " word", "12", " 345", "3.14", "x1", "-", "--",
          "?!", " (", "){", "_", "__init__", "http://x.y/z?q=1", "don't", "I'll", "you've"]


@pytest.fixture(scope="module")
def tokenizer(prepared_models: Path) -> Tokenizer:
    return Tokenizer.from_file(str(MODELS_DIR / "smollm2-135m-instruct" / "tokenizer.json"))


@pytest.fixture
def words(tokenizer: Tokenizer) -> ByteLevelWords:
    counter = ByteLevelWords.for_tokenizer(tokenizer)
    assert counter is not None  # SmolLM2's tokenizer is GPT-2's kind
    return counter


def encoded(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_sharegpt_turns_count_the_same(tokenizer: Tokenizer, words: ByteLevelWords) -> None:
    rng = random.Random(5)
    added = _added_token_cut(tokenizer)
    assert added is not None
    texts = [m["content"] for conv in sharegpt_conversations(limit=3000) for m in conv if m["content"].isascii()]
    assert len(texts) > 5000
    for text in texts:
        part = text[rng.randrange(len(text) + 1):][:rng.randint(1, 300)]  # starting and ending anywhere
        for piece in [*added.split(text)[::2], *added.split(part)[::2]]:  # as TokenCounter cuts a prompt
            assert words.count(piece) == encoded(tokenizer, piece), piece[:200]


def test_generated_ascii_counts_the_same(tokenizer: Tokenizer, words: ByteLevelWords) -> None:
    rng = random.Random(17)
    every_char = [chr(i) for i in range(128)]
    for _ in range(20_000):
        text = "".join(rng.choice(every_char) if rng.random() < 0.3 else rng.choice(TRICKY)
                       for _ in range(rng.randint(0, 30)))
        assert words.count(text) == encoded(tokenizer, text), repr(text)
        assert words.count(text) == encoded(tokenizer, text), repr(text)  # again, from what it remembered


def test_long_words_are_counted_not_remembered(tokenizer: Tokenizer, words: ByteLevelWords) -> None:
    long_word = "x" * (LONGEST_REMEMBERED + 1)
    text = f"a {long_word} b"
    assert words.count(text) == encoded(tokenizer, text)
    assert " " + long_word not in words._counts and "a" in words._counts and " b" in words._counts


def test_prompts_through_the_counter(prepared_models: Path) -> None:
    counter = TokenCounter(MODELS_DIR / "smollm2-135m-instruct")
    assert counter._words is not None
    rng = random.Random(3)
    convs = sharegpt_conversations(limit=300)
    for conv in convs:
        messages = conv[:rng.randint(1, 4)]
        whole = len(counter.tokenizer.encode(counter.render(messages), add_special_tokens=False).ids)
        assert counter.prompt_tokens(messages) == whole


def test_other_tokenizers_are_left_to_encode() -> None:
    def bpe(pre: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
        tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
        tok.pre_tokenizer = pre
        if normalizer is not None:
            tok.normalizer = normalizer
        return tok

    assert ByteLevelWords.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))) is not None
    assert ByteLevelWords.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=True))) is None
    assert ByteLevelWords.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))) is None
    assert ByteLevelWords.for_tokenizer(bpe(pre_tokenizers.Metaspace())) is None
    assert ByteLevelWords.for_tokenizer(bpe(pre_tokenizers.ByteLevel(add_prefix_space=False),
                                            normalizers.NFKC())) is None
    digits = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert ByteLevelWords.for_tokenizer(bpe(digits)) is None
