"""Prompt token counts at admission, from the tier model's own tokenizer and chat template, without torch.

The `tokenizers` library reads `tokenizer.json`; the chat template is rendered with jinja2 the way
transformers renders it (sandboxed, trim_blocks, lstrip_blocks), so the count equals what the engine
will see. Loaded once per model directory.

Counting reads tenant text, so it is bounded and kept off the event loop's GIL:
- `max_token_chars` is the longest token of the vocabulary in characters: a text longer than
  `limit * max_token_chars` cannot fit in `limit` tokens, so it is refused without being read;
- `encode_batch` is the call of `tokenizers` that releases the GIL while it works (`encode` holds it), so
  the callers run counts in a worker thread and the event loop keeps serving meanwhile.

A short prompt is counted by pieces: `tokenizers` cuts a text at its added tokens (`<|im_start|>`...) before
anything else and tokenizes each piece between them on its own, so a prompt's count is its added tokens plus
each piece's count, and the pieces every request repeats (the template's default system prompt, role markers) are
counted once and remembered. Only where that cut is the whole story: no normalizer, and no added token that eats
the spaces beside it or matches only whole words; otherwise the whole text is counted.

What is remembered is remembered for its owner (the tenant) only, within a bound of its own (`CountMemo`): a count
remembered across tenants answered faster for a text another tenant had sent (a refused probe of 3,000 characters
took 2.3 ms against 5.0 ms, right 52 times in 60), and one tenant's texts evicted another's. A conversation's earlier
turns and the template's own pieces are still counted once per tenant. Where a plan isolates its end users, a
count is remembered for the end user too (`user`), within the tenant's memo: another end user of the tenant could
time it the same way, and a tenant's many end users keep to the tenant's one bound.

A message's text that spells a special token (`<|im_end|>`) is counted as the text it is, as our engine tokenizes it
(wire/prompt_text.py): counted as the token (SmolLM2's `<|im_end|>`: 1 token, where the engine reads 7), a prompt
of such text was reserved and checked against the context at a part of its size, and billed at that part where the
engine's usage was past the meter's bound of belief (gateway/pipeline/meter.py: twice the count and 1024 more; 1,000
`<|im_end|>` counted 1,030, the engine's 6,031). Such a prompt is counted whole each time, nothing remembered: no
normal prompt holds one. So is a tenant's spelling of our own tool markers (`<tool_call>`, where the tokenizer has it
as a token, as Qwen's): the turns are made with `marker_escape`'s escape, which `prompt_tokens` and `rendered` take.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.bpe_words import ByteLevelWords
from wire.prompt_text import MarkerEscape, PlainTenantText

Messages = Sequence[dict[str, Any]]
SHORT_TEXT_CHARS = 8192  # counted with `encode` (GIL held, no hand-off); longer ones with `encode_batch`
RECENT_PROMPTS = 256  # short prompts whose counts are remembered, per owner
RECENT_PIECES = 1024  # pieces of short prompts (between added tokens) whose counts are remembered, per owner
RECENT_CHARS = 1 << 18  # and the characters of each memo's texts, per owner (at most 1 MiB of str: 4 bytes a char)
REPEATED_PROMPTS = 64  # short prompts sent again whose counts are remembered by their turns (no render), per owner
REPEATED_CHARS = 1 << 16  # and their rendered characters, per owner


class TokenCounter:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():  # the tokenizers library says only "No such file or directory", as an Exception
            raise FileNotFoundError(f"{path} is missing")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exceptions for a file it cannot read
            raise ValueError(f"{path} is not a tokenizer: {exc}") from exc
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template_file = model_dir / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if not source:
            raise ValueError(f"{model_dir} has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        self.template = env.from_string(source)
        self.special = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        # a vocabulary entry's length bounds the characters one token covers: byte-level entries spell one
        # symbol per byte, and a character is at least one byte
        self.max_token_chars = max(1, max(map(len, self.tokenizer.get_vocab(with_added_tokens=True))))
        self._overhead: dict[str, int] = {}
        self._recent = CountMemo(RECENT_PROMPTS, RECENT_CHARS)  # short rendered prompts -> tokens
        self._repeated = CountMemo(REPEATED_PROMPTS, REPEATED_CHARS)  # their turns (`_turns_key`) -> tokens
        self._pieces = CountMemo(RECENT_PIECES, RECENT_CHARS)  # pieces between added tokens -> tokens
        self._cut = _added_token_cut(self.tokenizer)
        self._words = ByteLevelWords.for_tokenizer(self.tokenizer)
        self._plain = PlainTenantText.for_tokenizer(self.tokenizer)  # None: no special token a tenant could spell

    def render(self, messages: Messages) -> str:
        return self.template.render(messages=list(messages), add_generation_prompt=True, **self.special)

    def count(self, text: str) -> int:
        """Tokens of `text`. A long text goes through `encode_batch`, which releases the GIL while it works (a
        worker thread's count then lets the event loop run); a short one through `encode`, which holds the GIL
        for microseconds and skips the batch call's thread-pool hand-off."""
        if len(text) <= SHORT_TEXT_CHARS:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def marker_escape(self) -> MarkerEscape | None:
        """A new request's escape of our tool markers in its tenant strings (wire/prompt_text.py), for
        wire/tool_calls.py's `turn` and `preamble`; None where the tokenizer reads them as text already."""
        return self._plain.marker_escape() if self._plain is not None else None

    def prompt_tokens(self, messages: Messages, owner: Hashable = None, user: Hashable = None, *,
                      specials_as_text: bool = True, markers: MarkerEscape | None = None) -> int:
        """Tokens of the rendered prompt. A short one's count, and its pieces', are remembered for `owner` (the
        tenant that sent it; None: the gateway's own texts) and only ever reused for the same owner. A short prompt
        sent a third time with the same turns is not even rendered again (the template's render, ~11 µs, was most of
        a repeated prompt's count): the render is a function of the turns alone. `user`: the end user `owner`'s plan
        isolates, for whom alone its counts are remembered. `specials_as_text` False: a text completion's prompt,
        whose special tokens' strings our engine reads as those tokens (engine/request_checks.py
        `PromptChecks.text_ids`). Only prompts without such strings are remembered, so the two readings never meet in
        the memos. `markers`: the escape `messages`' tenant strings were made with (`marker_escape`), if any."""
        turns = _turns_key(messages)
        if turns is not None and (counted := self._repeated.get(owner, turns, user)) is not None:
            return counted
        if self._plain is not None and (escaped := self._plain.escaped(messages, markers)) is not None:
            if not specials_as_text:  # (its markers' sentinels, where it was given any, put back)
                return self.count(self._plain.restored(self.render(messages), escaped))
            return self._plain.count(self.render(escaped.turns), escaped)  # a tenant's text spelling special tokens
        text = self.render(messages)
        if len(text) > SHORT_TEXT_CHARS:
            return self.count(text)
        counted = self._recent.get(owner, text, user)
        if counted is None:  # a repeated prompt (a retry, a shared system prompt and question) is counted once
            counted = self.count(text) if self._cut is None else self._count_pieces(text, owner, user)
            self._recent.put(owner, text, counted, user=user)
        elif turns is not None:  # sent again: from now on, not rendered either (a new prompt stores nothing more)
            self._repeated.put(owner, turns, counted, size=len(text), user=user)
        return counted

    def rendered(self, messages: Messages, *, specials_as_text: bool = True, markers: MarkerEscape | None = None,
                 ) -> tuple[str, Callable[[str], int]]:
        """The prompt `messages` render to, and what counts it or any prefix of it as our engine tokenizes it (a
        long prompt's count, nothing remembered): a tenant's text that spells a special token as text
        (`specials_as_text`, as `prompt_tokens`), the template's markers as tokens. The text holds a sentinel where a
        tenant's string spelled one (wire/prompt_text.py); a prefix cut inside one counts its pieces as text.
        `markers`: as `prompt_tokens`."""
        plain = self._plain
        escaped = plain.escaped(messages, markers) if plain is not None else None
        if escaped is None or plain is None:
            return self.render(messages), self.count
        if specials_as_text:
            return self.render(escaped.turns), lambda text: plain.count(text, escaped)
        return plain.restored(self.render(messages), escaped), self.count

    def _count_pieces(self, text: str, owner: Hashable = None, user: Hashable = None) -> int:
        """The count of a short text as its added tokens (one each) and its pieces between them (remembered for
        `owner`)."""
        assert self._cut is not None
        parts = self._cut.split(text)  # piece, added token, piece, ..., piece
        total = len(parts) // 2
        for piece in parts[::2]:
            if piece:
                counted = self._pieces.get(owner, piece, user)
                if counted is None:
                    counted = self._piece_tokens(piece)
                    self._pieces.put(owner, piece, counted, user=user)
                total += counted
        return total

    def _piece_tokens(self, piece: str) -> int:
        """Tokens of a piece with no added token in it: word by word when it is ASCII and the tokenizer is GPT-2's
        kind (gateway/bpe_words.py: the same count for a tenth of `encode`'s time), else `count`."""
        if self._words is not None and piece.isascii():
            return self._words.count(piece)
        return self.count(piece)

    def content_tokens(self, texts: Sequence[str], markers: MarkerEscape | None = None) -> list[int]:
        """Tokens of each text (a message's: a special token's string in it is text), in one call; `markers`: the
        escape the texts were made with (`marker_escape`), if any."""
        if self._plain is not None:
            return self._plain.texts_tokens(texts, markers)
        return [len(e.ids) for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def message_overhead(self, role: str) -> int:
        """Tokens the template adds around one more message of `role` (its markers and role name)."""
        if role not in self._overhead:
            one = [{"role": "user", "content": "x"}]
            two = [*one, {"role": role, "content": "x"}]
            self._overhead[role] = max(0, self.prompt_tokens(two) - self.prompt_tokens(one) - self.count("x"))
        return self._overhead[role]


def _turns_key(messages: Messages) -> tuple[tuple[tuple[str, Any], ...], ...] | None:
    """The turns as a key: every field of every turn, in order (what the template reads); None when a value cannot
    be a key (a list), and then the prompt is rendered as before."""
    try:
        key = tuple(tuple(m.items()) for m in messages)
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def _added_token_cut(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """A pattern that cuts a text where `tokenizer` does, at its added tokens (leftmost, then longest, as its
    matcher does); None when a piece's count would depend on its neighbours (a normalizer, an added token with
    lstrip, rstrip or single_word)."""
    added = list(tokenizer.get_added_tokens_decoder().values())
    if tokenizer.normalizer is not None or not added or any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")


class CountMemo:
    """Counts of texts, remembered per owner: an owner's lookups see only what its own counts remembered, and its
    entries are evicted only by its own (oldest first, past `entries` texts or `chars` characters of them). No
    memory is shared, so no owner's timing depends on another's traffic; the memory is `chars` (at most 4 bytes a
    character) for each owner that has counted, and owners are the gateway's tenants. A text counted for an end user
    (`user`: where the tenant's plan isolates them) is remembered for that end user within the owner's bounds.

    Not assets/owner_memo.py's `OwnerMemo` (entries and owners bounded, the least recently used out first, callers
    lock): here a key stands for a text of up to SHORT_TEXT_CHARS, so characters are bounded too, a lookup does not
    make a text newer, and worker threads put counts in under the memo's own lock."""

    def __init__(self, entries: int, chars: int) -> None:
        self.entries = entries
        self.chars = chars
        # owner -> (text -> (count, its characters), [characters in all])
        self._shelves: dict[Hashable, tuple[dict[Hashable, tuple[int, int]], list[int]]] = {}
        self._lock = threading.Lock()  # worker threads count too

    def get(self, owner: Hashable, text: Hashable, user: Hashable = None) -> int | None:
        shelf = self._shelves.get(owner)
        found = None if shelf is None else shelf[0].get(text if user is None else (user, text))
        return None if found is None else found[0]

    def put(self, owner: Hashable, text: Hashable, count: int, size: int | None = None, user: Hashable = None) -> None:
        """`size`: the characters `text` stands for, where it is not a str (its length)."""
        chars = len(text) if size is None else size  # type: ignore[arg-type]
        if chars > self.chars:
            return
        text = text if user is None else (user, text)
        with self._lock:
            memo, total = self._shelves.setdefault(owner, ({}, [0]))
            if text in memo:
                return
            memo[text] = (count, chars)
            total[0] += chars
            while len(memo) > self.entries or total[0] > self.chars:
                oldest = next(iter(memo))
                total[0] -= memo.pop(oldest)[1]

    def texts(self, owner: Hashable) -> list[str]:
        """What is remembered for `owner`, oldest first (for tests)."""
        shelf = self._shelves.get(owner)
        return [] if shelf is None else list(shelf[0])


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def token_counter(model_dir: Path) -> TokenCounter:
    return TokenCounter(model_dir)
