"""Incremental detokenization with stop strings, so text streams as tokens are made, in work linear per token.

Decoding follows vLLM's prefix/read offsets: each token decodes only a short window of the output, the
tokens since `prefix_offset` (the previous step's tokens, kept as context: a tokenizer may drop a leading
space at the start of a decode or merge pieces) up to the new one, and the new text is what the window adds
beyond its decoded prefix. A window whose text ends in U+FFFD (an unfinished UTF-8 character) waits for the
token that finishes it. In natural text that is one or two tokens (SmolLM2 on Chinese, Japanese, Korean,
Thai and emoji text: 2 at most); after MAX_HELD_TOKENS tokens in a row that leave the text unfinished
(invalid bytes, or tokens that each finish one character and start the next, as a hostile sampler can
make) the text is taken as it is, U+FFFD included, and decoding starts afresh after it. A token that adds
no text (a skipped special token) keeps the window's context for as long. So the window never grows past
2 * MAX_HELD_TOKENS tokens, whatever the model makes.

Stop strings are matched by one KMP automaton per stop string, fed each new character: its state is the
length of the longest prefix of the stop string that is a suffix of the text so far, which costs O(1)
amortised per character. Text that may still become a stop string (the largest state) is held back; a
complete match ends the text where the stop string begins. Where several stop strings complete on the same
token, the one that ends first wins (the longest among those ending on the same character), as if the text
had come one character at a time.
"""

from __future__ import annotations

from collections import deque
from typing import Any

MAX_HELD_TOKENS = 8  # tokens a trailing U+FFFD may wait for its character before it is taken as it is


class StopMatcher:
    """A KMP automaton for one stop string over the text fed to it, one character at a time."""

    __slots__ = ("_fail", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0  # length of the longest prefix of `stop` that is a suffix of the text fed so far
        # _fail[i]: length of the longest proper prefix of stop[:i + 1] that is also its suffix
        self._fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fail[i] = k

    def feed(self, ch: str) -> bool:
        """Advance by one character; True when the text now ends with the whole stop string."""
        stop, state = self.stop, self.state
        while state and stop[state] != ch:
            state = self._fail[state - 1]
        if stop[state] == ch:
            state += 1
        if state == len(stop):
            self.state = self._fail[state - 1]  # as if the text went on (the engine stops at a match)
            return True
        self.state = state
        return False


class IncrementalDetokenizer:
    """Feeds token ids, yields new text; holds back text that may still become a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._matchers = [StopMatcher(s) for s in stop if s]
        self._ids: list[int] = []
        self._prefix_offset = 0  # the decode window starts here (context for the tokens after read_offset)
        self._read_offset = 0  # tokens before this have had their text taken
        self._emitted: list[str] = []  # text returned so far, in pieces
        self._held: deque[str] = deque()  # decoded text not returned yet (may start a stop string), in pieces
        self._num_held_chars = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """The decoded text so far (cut where a stop string begins), returned or held."""
        return "".join(self._emitted) + "".join(self._held)

    def feed(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to send."""
        self._ids.append(token_id)
        new = self._decode_new()
        if not new:
            return ""
        if not self._matchers:
            self._emitted.append(new)
            return new
        before = self._num_held_chars
        self._held.append(new)
        self._num_held_chars += len(new)
        for k, ch in enumerate(new):
            matched = [m for m in self._matchers if m.feed(ch)]  # every automaton sees every character
            if matched:
                self.stopped = True
                piece = self._take(before + k + 1 - max(len(m.stop) for m in matched))
                self._held.clear()
                self._num_held_chars = 0
                return piece
        hold = max(m.state for m in self._matchers)
        return self._take(self._num_held_chars - hold)

    def flush(self) -> str:
        """The held-back text, once the sequence has ended for another reason."""
        return self._take(self._num_held_chars)

    def _decode_new(self) -> str:
        """The text the newest token adds: decode the short window, keep what its prefix did not have."""
        ids = self._ids
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        if full.endswith("\ufffd"):
            if len(ids) - self._read_offset < MAX_HELD_TOKENS:
                return ""  # an incomplete character: wait for the bytes that finish it
            self._prefix_offset = self._read_offset = len(ids)  # bytes that never form one: decode afresh
            return full[len(prefix):]
        new = full[len(prefix):]
        # a token that adds no text (a skipped special token) keeps the window's context, up to a bound
        if new or self._read_offset - self._prefix_offset >= MAX_HELD_TOKENS:
            self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _take(self, num_chars: int) -> str:
        """Return the first `num_chars` held characters, keeping the rest held."""
        parts: list[str] = []
        left = num_chars
        while left > 0:
            head = self._held[0]
            if len(head) <= left:
                parts.append(self._held.popleft())
                left -= len(head)
            else:
                parts.append(head[:left])
                self._held[0] = head[left:]
                left = 0
        self._num_held_chars -= num_chars
        piece = "".join(parts)
        if piece:
            self._emitted.append(piece)
        return piece
