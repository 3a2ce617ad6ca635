"""What the difficulty predictor sees of a request: an embedding of what is asked, and a few simple signals.

- The all-MiniLM-L6-v2 embedding (384 numbers) of the last user turn: what the request is about and what
  kind of task it is (the model reads its first 256 word pieces, where the task is usually stated). Topic
  matters: a small model copes with chit-chat and fails at code, maths and rare languages.
- Simple features (`SIMPLE_FEATURES`), cheap to compute and hard for an embedding to encode: how long the
  request is (a long context is harder to follow), how many turns it has, whether it has code, how much of
  it is outside ASCII and outside the Latin script (small models are mostly English-trained), digits
  (arithmetic), and what kind of request it opens with (a question word, an imperative like "write",
  "explain", "translate", "fix").

Lengths use log1p so a 20,000-character paste does not swamp the rest; counts of tokens come from the
embedding model's tokenizer (no tier's tokenizer is needed, and it is loaded anyway). `FEATURE_VERSION`
and the feature names are stored in the artifact; a model trained on other features does not load.

The text is a tenant's and `auto` routing reads it before any model runs, so the work is linear and bounded:
the embedding and every text feature read the first `TEXT_WINDOW` characters of the last user turn (its last
ones for `ends_with_question`), character lengths are taken whole (len() is free), and token and line counts
of a longer turn are those of the window scaled by its share of the turn. Every pattern is linear (possessive
quantifiers, no rescanning of a word or a line). For a turn within the window every feature is what it was
before the window existed, so a trained artifact stays valid: FEATURE_VERSION is unchanged.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np

from wire.chat_request import SYSTEM_ROLES

FEATURE_VERSION = "router-features-v1"
TEXT_WINDOW = 8192  # characters of the last user turn the features read; router training prompts are shorter
EMBEDDING = "all-MiniLM-L6-v2:last-user-turn"
EMBEDDING_DIM = 384

QUESTION_TYPES = ("wh", "how", "why", "yesno", "write", "explain", "translate", "fix", "list")
SIMPLE_FEATURES = (
    "log_chars_last_user", "log_tokens_last_user", "log_chars_conversation", "num_user_turns",
    "has_system", "has_code", "code_fence", "non_ascii_frac", "non_latin_frac", "digit_frac", "num_lines_log",
    "ends_with_question", "has_url",
    *(f"qtype_{q}" for q in QUESTION_TYPES),
)

# Case-sensitive: "Let me know" and "Select the best" are prose. Each alternative is linear: a keyword line's
# indent and a brace's trailing blanks stop at the line end, and a call is tried only from the start of its name
# (or just after the one character an "x==y" match can take from inside a name), never from every letter of it.
# These choices keep the number of matches what the plain patterns (`^\s*`, `\s*$`, `\w+\(`) find.
_CODE_PATTERNS = re.compile(
    r"^[^\S\n]*+(def|class|import|from\s++\S++\s++import|function|const|let|var|public|private|return|#include|"
    r"package|SELECT|INSERT|UPDATE|CREATE\s++TABLE)\s|[{};][^\S\n]*+$|=>|"
    r"(?:(?<!\w)|(?<==\w))\w++\([^()\n]*+\)\s*+[{:;]|</?[a-z]++[^>]*+>|\$[A-Za-z_]\w*+|[^=!<>]==[^=]|!=|\+\+|&&|\|\|",
    re.MULTILINE,
)
_TAG_START = re.compile(r"<([a-z/])")
_URL = re.compile(r"https?://|www\.", re.IGNORECASE)
_QTYPE_WORDS: dict[str, tuple[str, ...]] = {
    "wh": ("what", "who", "whom", "whose", "when", "where", "which"),
    "how": ("how",),
    "why": ("why",),
    "yesno": ("is", "are", "can", "could", "do", "does", "did", "should", "would", "will", "was", "were", "may"),
    "write": ("write", "create", "generate", "compose", "draft", "make", "design", "build", "implement"),
    "explain": ("explain", "describe", "summarize", "summarise", "tell", "define", "compare", "discuss"),
    "translate": ("translate", "rewrite", "paraphrase", "rephrase", "correct", "proofread"),
    "fix": ("fix", "debug", "solve", "calculate", "compute", "optimize", "refactor", "convert"),
    "list": ("list", "give", "suggest", "name", "provide", "recommend"),
}
_FIRST_WORDS = {w: q for q, words in _QTYPE_WORDS.items() for w in words}


def message_text(message: dict[str, Any]) -> str:
    """The text of one chat message: a string, or OpenAI content parts ({"type": "text", "text": …})."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def last_user_turn(messages: Sequence[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message)
    return message_text(messages[-1]) if messages else ""


def has_code(text: str) -> bool:
    """Two or more code-looking lines (or one code fence) in the first TEXT_WINDOW characters: keywords at a line
    start, braces or semicolons at a line end, calls, tags, comparison operators. Prose rarely trips two of them."""
    text = text[:TEXT_WINDOW]
    if "```" in text:
        return True
    return len(_CODE_PATTERNS.findall(_without_open_tags(text))) >= 2


def _without_open_tags(text: str) -> str:
    """`text` where a tag start ("<a", "</") after the last ">" cannot start a tag match: such a start can never
    close, and "<a<a<a..." would make the tag pattern scan to the end from each one. Its letter is upper-cased and
    its "/" becomes a control character, which keeps every other pattern's matches as they were."""
    tail = text.rfind(">") + 1
    if text.find("<", tail) < 0:
        return text
    return text[:tail] + _TAG_START.sub(lambda m: "<" + ("\x01" if m.group(1) == "/" else m.group(1).upper()),
                                        text[tail:])


def script_fractions(text: str) -> tuple[float, float]:
    """(fraction of letters outside ASCII, fraction of letters outside the Latin script), in the first TEXT_WINDOW
    characters."""
    letters = [c for c in text[:TEXT_WINDOW] if c.isalpha()]
    if not letters:
        return 0.0, 0.0
    non_ascii = sum(1 for c in letters if ord(c) > 127)
    non_latin = sum(1 for c in letters if ord(c) > 127 and not unicodedata.name(c, "").startswith("LATIN"))
    return non_ascii / len(letters), non_latin / len(letters)


def question_type(text: str) -> str | None:
    """The kind of request, from its first word (one of QUESTION_TYPES), or None."""
    match = re.search(r"[A-Za-z]+", text[:200])
    if not match:
        return None
    return _FIRST_WORDS.get(match.group(0).lower())


def scaled_count(count_in_window: float, window: str, text: str) -> float:
    """A count taken over `window` (the start of `text`) scaled to the whole of `text`; exact when they are equal."""
    return count_in_window if len(window) == len(text) else count_in_window * len(text) / max(len(window), 1)


def simple_features(messages: Sequence[dict[str, Any]], num_tokens_last_user: float) -> np.ndarray:
    """The SIMPLE_FEATURES vector of a conversation (float64), from the last user turn's first TEXT_WINDOW
    characters (its last ones for the closing "?"); `num_tokens_last_user` comes from the caller."""
    last = last_user_turn(messages)
    head = last[:TEXT_WINDOW]
    chars_conversation = sum(len(message_text(m)) for m in messages) + max(len(messages) - 1, 0)  # "\n"-joined
    non_ascii, non_latin = script_fractions(head)
    qtype = question_type(head)
    values = [
        math.log1p(len(last)), math.log1p(num_tokens_last_user), math.log1p(chars_conversation),
        float(sum(1 for m in messages if m.get("role") == "user")),
        float(any(m.get("role") in SYSTEM_ROLES for m in messages)),
        float(has_code(head)), float("```" in head), non_ascii, non_latin,
        sum(c.isdigit() for c in head) / max(len(head), 1), math.log1p(scaled_count(head.count("\n"), head, last)),
        float(last[-TEXT_WINDOW:].rstrip().endswith("?")), float(bool(_URL.search(head))),
        *(float(qtype == q) for q in QUESTION_TYPES),
    ]
    return np.asarray(values, dtype=np.float64)


class FeatureExtractor:
    """[embedding | simple features] rows for conversations. The embedder (cache/embedder.py's Embedder, or
    anything with `encode(texts)` and `num_tokens(text)`) is the process-wide one unless given, and is
    loaded on first use, not at construction."""

    def __init__(self, embedder: Any = None) -> None:
        self._embedder = embedder

    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            from cache.embedder import default_embedder

            self._embedder = default_embedder()
        return self._embedder

    @property
    def dim(self) -> int:
        return EMBEDDING_DIM + len(SIMPLE_FEATURES)

    def features(self, conversations: Sequence[Sequence[dict[str, Any]]]) -> np.ndarray:
        """[N, 384 + len(SIMPLE_FEATURES)] float64."""
        if not conversations:
            return np.zeros((0, self.dim))
        lasts = [last_user_turn(c) for c in conversations]
        heads = [last[:TEXT_WINDOW] for last in lasts]  # what the embedding and the token count read
        emb = np.asarray(self.embedder.encode(heads), dtype=np.float64)
        if emb.shape != (len(lasts), EMBEDDING_DIM):
            raise ValueError(f"the embedder returned {emb.shape}, expected ({len(lasts)}, {EMBEDDING_DIM})")
        simple = np.stack([simple_features(c, scaled_count(self.embedder.num_tokens(head), head, last))
                           for c, head, last in zip(conversations, heads, lasts, strict=True)])
        return np.concatenate([emb, simple], axis=1)
