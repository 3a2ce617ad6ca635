"""Router features on hostile text: linear work, a bounded window, and unchanged values within the window."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.text_reads import TextReads, best_cpu_time
from tiers import router_features
from tiers.router_features import (
    EMBEDDING_DIM,
    SIMPLE_FEATURES,
    TEXT_WINDOW,
    FeatureExtractor,
    has_code,
    simple_features,
)


class RecordingEmbedder:
    """Constant vectors and one token per character; remembers the longest text it was handed."""

    def __init__(self) -> None:
        self.longest = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        self.longest = max([self.longest, *map(len, texts)])
        out = np.zeros((len(texts), EMBEDDING_DIM), dtype=np.float32)
        out[:, 0] = 1.0
        return out

    def num_tokens(self, text: str) -> int:
        self.longest = max(self.longest, len(text))
        return len(text)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize(("text", "code"), [
    ("if x==foo(y):", True),  # "x==f" then "oo(y):": a call found after a comparison ends inside its name
    ("\n\n  def f(x):\n", True),  # a keyword after blank lines, then a call
    ("total;\n\n\nreturn x\n", True),  # a semicolon before blank lines, then a keyword
    ("<b>x</b>", True),
    ("x <a <b", False),  # tags that never close
    ("print(a)\n</a", False),
    ("a" * 50 + "(", False),
    ("f(x) {\n" + " " * 10, False),
    ("Let me know what you think.", False),
])
def test_code_detection_edge_cases(text: str, code: bool) -> None:
    assert has_code(text) is code


ADVERSARIAL: dict[str, Callable[[int], str]] = {
    "one long word, then (": lambda n: "a" * n + "(",
    "a( pairs": lambda n: "a(" * (n // 2),
    "newlines": lambda n: "\n" * n,
    "a semicolon before blank lines": lambda n: ";" + " \n" * (n // 2) + "x",
    "tags that never close": lambda n: "<a" * (n // 2),
    "closing tags that never close": lambda n: "</" * (n // 2),
    "from lines without import": lambda n: "from a\n" * (n // 7),
    "a call before blanks": lambda n: "f(x)" + " " * n,
    "comparisons ending inside names": lambda n: ("x==" + "b" * 50 + "(") * (n // 54),
    "capitalized words": lambda n: "Abc " * (n // 4),
    "mixed": lambda n: "def f(x): return x==1; <b>y</b> $z && w\n" * (n // 40),
}


@pytest.mark.parametrize("make", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_code_detection_is_linear_even_without_the_window(make: Callable[[int], str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten times the text, about ten times the work (a quadratic pattern takes a hundred times, and seconds)."""
    monkeypatch.setattr(router_features, "TEXT_WINDOW", 10**9)
    small, large = best_cpu_time(has_code, make(50_000), repeats=3), best_cpu_time(has_code, make(500_000), repeats=3)
    assert large < 30 * small + 0.01, (small, large)


@pytest.mark.parametrize("make", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_four_megabytes_are_read_no_further_than_the_window(make: Callable[[int], str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's 4 MB turn costs what the window costs: neither the embedding, nor the token count, nor any scan of
    the simple features (their functions and patterns) is handed more than TEXT_WINDOW characters of it; only its
    length is read whole (`scaled_count`). Counted, not timed."""
    embedder = RecordingEmbedder()
    conversation = user(make(4_000_000))
    reads = TextReads.watch(monkeypatch, router_features, unwatched=("scaled_count",))
    row = FeatureExtractor(embedder).features([conversation])
    assert row.shape == (1, EMBEDDING_DIM + len(SIMPLE_FEATURES))
    assert embedder.longest <= TEXT_WINDOW  # neither the embedding nor the token count reads past the window
    assert 0 < reads.longest <= TEXT_WINDOW, reads.by


def test_a_long_turn_is_described_by_its_window_and_its_length() -> None:
    head = "Why does this fail?\ndef f(x):\n    return x + 1\nSee https://example.com 42\n" * 200
    head = head[:TEXT_WINDOW]
    assert len(head) == TEXT_WINDOW
    long = head + "plain words and no code at all " * 10_000
    short_f = dict(zip(SIMPLE_FEATURES, simple_features(user(head), 10), strict=True))
    long_f = dict(zip(SIMPLE_FEATURES, simple_features(user(long), 10), strict=True))
    for name in ("has_code", "non_ascii_frac", "digit_frac", "has_url", "qtype_why"):
        assert long_f[name] == short_f[name], name
    assert long_f["log_chars_last_user"] == pytest.approx(np.log1p(len(long)))  # lengths are taken whole
    assert long_f["log_chars_conversation"] == pytest.approx(np.log1p(len(long)))
    lines = head.count("\n") * len(long) / len(head)
    assert long_f["num_lines_log"] == pytest.approx(np.log1p(lines))  # the window's lines, scaled to the turn
    assert long_f["ends_with_question"] == 0.0 and simple_features(user(long + " ok?"), 10)[
        SIMPLE_FEATURES.index("ends_with_question")] == 1.0  # read at the end, whatever the length


def test_the_token_count_of_a_long_turn_is_scaled_from_its_window() -> None:
    embedder = RecordingEmbedder()  # one token per character
    text = "x" * (3 * TEXT_WINDOW)
    row = FeatureExtractor(embedder).features([user(text)])[0]
    assert row[EMBEDDING_DIM + SIMPLE_FEATURES.index("log_tokens_last_user")] == pytest.approx(np.log1p(len(text)))
    assert embedder.longest == TEXT_WINDOW
