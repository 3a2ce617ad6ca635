"""A stream's `tool_calls` delta entries joined into whole calls, for the meter's outcome and the JSON answer alike.

An entry names its call by `index`; the first of a call brings its id, type and name, and every entry may bring a
piece of its arguments. The pieces are kept as they come and joined once, when the calls are read: a piece appended
to the string so far copied it, quadratic in a call whose length the tenant chooses (128,000 pieces took the event
loop about a second). An upstream's entry is read defensively (a `function` that is not an object brings nothing).
"""

from __future__ import annotations

from typing import Any


class ToolCallPieces:
    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}  # index -> the call so far, its arguments joined by `calls`
        self._arguments: dict[int, list[str]] = {}  # index -> its arguments' pieces, in order

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, entry: dict[str, Any]) -> None:
        """One delta entry, whose `index` is an int (the caller keeps only those)."""
        index = entry.get("index", 0)
        call = self._calls.setdefault(index, {"id": None, "type": "function",
                                              "function": {"name": None, "arguments": ""}})
        fn = entry.get("function") if isinstance(entry.get("function"), dict) else {}
        call["id"] = entry.get("id") or call["id"]
        call["type"] = entry.get("type") or call["type"]
        call["function"]["name"] = fn.get("name") or call["function"]["name"]
        if isinstance(fn.get("arguments"), str):
            self._arguments.setdefault(index, []).append(fn["arguments"])

    def calls(self) -> list[dict[str, Any]]:
        """The calls so far, in index order, each with its arguments joined."""
        for index, pieces in self._arguments.items():
            self._calls[index]["function"]["arguments"] = "".join(pieces)
        return [self._calls[i] for i in sorted(self._calls)]
