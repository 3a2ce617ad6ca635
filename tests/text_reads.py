"""What the tests of hostile text share: how much of a text a module's scans are handed, and a scan's own CPU time.

A window (cache/guards.py's MAX_CHARS, tiers/router_features.py's TEXT_WINDOW) bounds what a tenant's text costs.
Whether it holds is counted, not timed: `TextReads.watch` wraps a module's functions and compiled patterns and notes
the longest text any of them is handed, so a test asserts that no scan saw past the window, however loaded the
machine. Whether a scan is linear once the window is lifted cannot be counted (`re` reports no steps, and a pattern
that backtracks does it inside one C call), so `best_cpu_time` times it, and the tests compare ten times the text
against about ten times the time: a ratio, not a speed target, which a quadratic scan misses by a factor of ten.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import pytest


class TextReads:
    """The longest text handed to any watched function or pattern (`longest`), and which took it (`by`)."""

    def __init__(self) -> None:
        self.longest = 0
        self.by: dict[str, int] = {}

    @classmethod
    def watch(cls, monkeypatch: pytest.MonkeyPatch, module: ModuleType, *,
              unwatched: Iterable[str] = ()) -> TextReads:
        """Wrap every compiled pattern of `module` and every function it holds from its own package (the helpers it
        imports from a sibling module included), but those named in `unwatched`: what they are handed is noted
        until the test ends. Wrapped here, a call between two of them is seen too (they look each other up in the
        module)."""
        reads = cls()
        package = module.__name__.split(".")[0]
        skip = set(unwatched)
        for name, obj in list(vars(module).items()):
            if name in skip or isinstance(obj, type | ModuleType):
                continue
            ours = callable(obj) and getattr(obj, "__module__", "").split(".")[0] == package
            if isinstance(obj, re.Pattern) or ours:
                monkeypatch.setattr(module, name, _Noting(name, obj, reads))
        return reads

    def note(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, str) and len(arg) > self.by.get(name, -1):
                self.by[name] = len(arg)
                self.longest = max(self.longest, len(arg))


class _Noting:
    """`target` (a function, or a pattern whose methods are called) that notes the texts handed to it first."""

    def __init__(self, name: str, target: Any, reads: TextReads) -> None:
        self._name, self._target, self._reads = name, target, reads

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._reads.note(self._name, args, kwargs)
        return self._target(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._target, attr)
        if not callable(value) or not isinstance(self._target, re.Pattern):
            return value  # a function's attributes (an lru_cache's cache_clear) as they are

        def method(*args: Any, **kwargs: Any) -> Any:
            self._reads.note(f"{self._name}.{attr}", args, kwargs)
            return value(*args, **kwargs)
        return method


def best_cpu_time(fn: Callable[[str], object], text: str, *, repeats: int = 5,
                  before: Callable[[], object] = lambda: None) -> float:
    """The least CPU time of this thread `fn(text)` took over `repeats` runs, each after `before()` (to empty a
    cache): its own work, which other processes' load does not add to (wall time on a loaded machine's preemptions
    made a linear scan look 35 times slower at 10 times the text)."""
    best = float("inf")
    for _ in range(repeats):
        before()
        start = time.thread_time()
        fn(text)
        best = min(best, time.thread_time() - start)
    return best
