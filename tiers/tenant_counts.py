"""Each tenant's part of a shared signal's sliding window, and which tenant the signal leaves out.

A replica's breaker (tiers/breaker.py) and the ladder's error rate and dispatch-wait p95 (gateway/ladder/signals.py)
are shared: what one tenant's requests do to them, every tenant lives with. A tenant can send what makes a replica
fail (an input an engine or provider chokes on) or flood a tier so that its own requests queue (dispatch is fair
between tenants, so the others' do not): left alone, its own failures or waits would open the breaker or take the
ladder down for everyone. So a signal is read as the others see it: it leaves out the tenant that dominates it (the
most failures, the most waits) when the other tenants have enough outcomes of their own (`contest_min`) to say how
things are for them. A fault that hits everyone fails or delays the others too, and shows; the only tenant, and
tenant "" (the gateway's own calls: probes, shadows), count as usual, and "" is never left out.

`TenantCounts` keeps the counts as outcomes enter and leave the caller's window, O(1) each (every request adds one);
reading who is left out costs one pass over the tenants in the window, once per decision.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

OUTCOMES, BAD = 0, 1  # what a tenant is ranked by: its outcomes (waits) or its bad ones (failures, 5xx)


class TenantCounts:
    """Each tenant's outcomes and bad outcomes inside a window, and their totals. The caller keeps the window (its
    deque says which outcome leaves when) and tells each one entering (`add`) and leaving (`remove`)."""

    __slots__ = ("bad", "by_tenant", "n")

    def __init__(self) -> None:
        self.by_tenant: dict[str, list[int]] = {}  # tenant -> [outcomes, bad] in the window
        self.n = 0  # outcomes in the window
        self.bad = 0  # bad ones among them

    def add(self, tenant: str, bad: bool = False) -> None:
        self._step(tenant, bad, 1)

    def remove(self, tenant: str, bad: bool = False) -> None:
        self._step(tenant, bad, -1)

    def _step(self, tenant: str, bad: bool, step: int) -> None:
        counts = self.by_tenant.setdefault(tenant, [0, 0])
        counts[OUTCOMES] += step
        counts[BAD] += step * bad
        self.n += step
        self.bad += step * bad
        if not counts[OUTCOMES]:
            del self.by_tenant[tenant]

    def clear(self) -> None:
        self.by_tenant.clear()
        self.n = self.bad = 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_tenant)

    def __len__(self) -> int:
        return len(self.by_tenant)

    def without(self, tenants: Collection[str]) -> tuple[int, int]:
        """Outcomes and bad outcomes in the window but `tenants`'."""
        n, bad = self.n, self.bad
        for tenant in tenants:
            own = self.by_tenant.get(tenant)
            if own is not None:
                n, bad = n - own[OUTCOMES], bad - own[BAD]
        return n, bad

    def rate_without(self, tenants: Collection[str]) -> float:
        """The share of bad outcomes but `tenants`' (0 with none left)."""
        n, bad = self.without(tenants)
        return bad / n if n else 0.0


def left_out(counts: TenantCounts, contest_min: int, *, by: int = BAD) -> frozenset[str]:
    """The tenants the signal leaves out: the one with the most bad outcomes (`by=BAD`) or the most outcomes
    (`by=OUTCOMES`), when it is not "" and the others have at least `contest_min` outcomes in the window; else none."""
    if not counts.by_tenant:
        return frozenset()
    top, own = max(counts.by_tenant.items(), key=lambda kv: kv[1][by])
    if not top or counts.n - own[OUTCOMES] < contest_min:
        return frozenset()
    return frozenset((top,))
