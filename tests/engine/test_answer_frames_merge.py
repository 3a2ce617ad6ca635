"""A whole answer's log-probabilities are gathered an output (a token) at a time: each output's are added to those
before in place. Joined anew for each output, every entry so far was copied again, quadratic in the answer: 8,000
tokens of legacy log-probabilities cost the engine server's event loop 0.4 s."""

from __future__ import annotations

from typing import Any

from engine.answer_frames import Frames


class CountedList(list[Any]):
    """An output's entries, counting the entries copied when a list is joined to them (`so_far + entries`)."""

    copied = 0

    def __radd__(self, other: list[Any]) -> list[Any]:
        CountedList.copied += len(other) + len(self)
        return [*other, *self]


def test_log_probabilities_are_gathered_without_copying_those_before() -> None:
    frames = Frames.__new__(Frames)  # merge reads nothing of the frames
    n = 2000
    legacy: Any = None
    chat: Any = None
    CountedList.copied = 0
    for i in range(n):
        legacy = frames.merge(legacy, {"tokens": CountedList([f"t{i}"]), "token_logprobs": CountedList([-0.5]),
                                       "top_logprobs": CountedList([{f"t{i}": -0.5}]),
                                       "text_offset": CountedList([i])})
        chat = frames.merge(chat, CountedList([{"token": f"t{i}", "logprob": -0.5}]))
        assert frames.merge(chat, None) is chat
    assert legacy["tokens"] == [f"t{i}" for i in range(n)] and legacy["text_offset"] == list(range(n))
    assert [e["token"] for e in chat] == [f"t{i}" for i in range(n)]
    assert CountedList.copied <= 5 * n  # each entry once; joined anew, 5 x n^2 / 2
