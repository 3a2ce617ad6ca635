"""The semantic layer's screening of the nearest entries: which may be served, and why none may.

The index proposes the entries nearest a query's vector, best first (cache/index.py); `screen` reads them in that
order against the tenant's threshold, the fallback margin and the near-miss guards (cache/guards.py), and stops as
soon as the rest cannot change the outcome. It decides nothing about serving: it hands `SemanticCache` the entries
that may be served (nearest first, at most MEANING_CHECKED under the meaning check, one otherwise), why none may,
and a near miss below the threshold for the tier's answer to label (cache/error_bound.py). The store reads, the
liveness and TTL rules and the meaning check are the cache's, passed in (`fetch`, `checked`), so this holds only
the order of the rules and none of the cache's state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache import guards
from cache.meaning_gate import MEANING_CHECKED
from cache.results import Near
from cache.store import Entry

Checked = Callable[[list[tuple[Entry, float]]], tuple[tuple[Entry, float] | None, str]]


@dataclass(slots=True)
class Screened:
    """What `screen` found among the nearest entries, for the cache to serve or miss with."""

    servable: list[tuple[Entry, float]]  # above the threshold and past the guards, nearest first
    refusal: str  # the miss's reason if none is served: "below threshold (best 0.71)" or the first guard refusal
    near: Near | None  # a candidate just below the threshold whose fresh answer labels it for the tenant's bound


def screen(candidates: Sequence[tuple[str, float]], query: str, *, threshold: float, floor: float,
           fallback_margin: float, meaning_check: bool, tenant: str, fetch: Callable[[str], Entry | None],
           checked: Checked, refused: Counter[str], user: str | None = None) -> Screened:
    """Screen `candidates` (entry id, similarity; nearest first, at least one) for the last user turn `query`, as
    sent. `floor`: the lowest similarity worth labelling as a near miss (at most `threshold`); `fetch`: an entry the
    lookup may serve (stored, alive, within the tenant's TTL) or None; `checked`: the candidate the plan's meaning
    check would serve of those given (`LookupPass.checked`); each guard refusal is counted in `refused`. The guards
    remember what the texts read as for `tenant` and its end user `user` (the scope's, where its plan isolates them)
    alone (cache/guards.py)."""
    best = candidates[0][1]
    refusal, near = f"below threshold (best {best:.3f})", None
    servable: list[tuple[Entry, float]] = []
    for entry_id, similarity in candidates:
        if similarity < floor or similarity < best - fallback_margin:
            break
        entry = fetch(entry_id)
        if entry is None:
            continue
        reason = guards.check(query, entry.semantic_text, owner=tenant, user=user)
        if reason is not None:
            refused[reason] += 1
            if refusal.startswith("below"):
                refusal = f"refused near miss: {reason} ({similarity:.3f})"
            continue
        if similarity < threshold:  # the tier answers; its answer labels this candidate for the bound
            # (under the meaning check, only a candidate it accepts: the bound learns the error of what the
            # threshold and the check would serve together)
            if not servable and checked([(entry, similarity)])[0] is not None:
                near = Near(tenant, similarity, entry.response)
            break
        servable.append((entry, similarity))
        if not meaning_check or len(servable) >= MEANING_CHECKED:  # no more need reading
            break
    return Screened(servable, refusal, near)
