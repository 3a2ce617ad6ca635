"""Where the meaning check (cache/meaning_check.py) meets a lookup: which of its candidates a plan with
`meaning_check` may be served, and the refusals it counts.

Candidates are checked nearest first and the first one accepted is the answer, so a lookup pays one pass when its
nearest candidate is right and `MEANING_CHECKED` passes at most. A check that cannot run (no model, a failure, no
free slot) refuses: the plan asked for the check, so nothing goes out unchecked.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

from cache.meaning_check import MeaningBusy, MeaningCheck, MeaningUnavailable

# Candidates the meaning check reads at most per lookup (24-36 ms of CPU each at p50 on a Zen 4 core, ~120 ms at its
# 160 tokens): the nearest two, so one lookup cannot buy more than two passes.
MEANING_CHECKED = 2
MEANING_DIFFERS = "meaning differs"  # the check's refusals, as `CacheStats.refused` reasons
MEANING_UNAVAILABLE = "meaning check unavailable"
MEANING_BUSY = "meaning check busy"

log = logging.getLogger("tiergate.cache")
C = TypeVar("C")


def first_accepted(check: MeaningCheck, query: str, candidates: Sequence[tuple[str, C]], *, scope: str, owner: str,
                   refused: Counter[str]) -> tuple[C | None, str]:
    """The first candidate (its cached question, nearest first) whose question `query` asks again, or None and why
    none was; each refusal is counted in `refused`. `owner`: the tenant, whose turn a pass waits for."""
    for cached, candidate in candidates:
        try:
            if check.accepts(cached, query, scope=scope, owner=owner):
                return candidate, ""
        except MeaningBusy:
            refused[MEANING_BUSY] += 1
            return None, MEANING_BUSY
        except MeaningUnavailable as exc:
            if not refused[MEANING_UNAVAILABLE]:  # logged once; counted every time
                log.error("semantic hits of plans with cache.meaning_check are refused: %s", exc)
            refused[MEANING_UNAVAILABLE] += 1
            return None, MEANING_UNAVAILABLE
        refused[MEANING_DIFFERS] += 1
    return None, MEANING_DIFFERS
