"""A tenant store's read whose first call is held until let go: a read begun before a change, answered after it
(tests of what a read in flight across a change may be joined by, or leave in a cache)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HeldRead:
    began: threading.Event = field(default_factory=threading.Event)  # the first call has read, and waits
    let_go: threading.Event = field(default_factory=threading.Event)  # set: it returns what it read
    calls: int = 0  # calls so far, the first included


def hold_first(store: Any, name: str) -> HeldRead:
    """Replace `store`'s one-argument read `name` (e.g. `_fetch_entry`) by one whose first call, having read, waits
    for `let_go` (20 s at most)."""
    held, read = HeldRead(), getattr(store, name)

    def first_held(arg: Any) -> Any:
        value = read(arg)
        held.calls += 1
        if held.calls == 1:
            held.began.set()
            held.let_go.wait(20)
        return value

    setattr(store, name, first_held)
    return held
