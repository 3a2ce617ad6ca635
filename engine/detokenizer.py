"""Incremental detokenization with stop strings, so text streams as tokens are made."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Feeds token ids, yields new text; holds back text that may still become a stop string.

    Decoding the whole output each step keeps multi-byte characters and merged pieces right; a
    trailing U+FFFD (an incomplete UTF-8 sequence) is held until the next token completes it.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned
        self.text = ""
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to send."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        for stop in self._stop:
            at = text.find(stop, max(0, self._emitted - len(stop)))
            if at != -1:
                self.text = text[:at]
                self.stopped = True
                return self._take(at)
        # hold back a suffix that is a prefix of some stop string
        hold = max((k for s in self._stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._take(len(text) - hold)

    def flush(self) -> str:
        """The held-back text, once the sequence has ended for another reason."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece
