"""Each tenant's part of a shared signal's sliding window, and which tenants the signal leaves out.

A replica's breaker (tiers/breaker.py) and the ladder's error rate and dispatch-wait p95 (gateway/ladder/signals.py)
are shared: what one tenant's requests do to them, every tenant lives with. A tenant can send what makes a replica
fail (an input an engine or provider chokes on) or flood a tier so that its own requests queue (dispatch is fair
between tenants, so the others' do not): left alone, its own failures or waits would open the breaker or take the
ladder down for everyone. So a signal is read as the others see it: it leaves out the tenant that dominates it (the
most failures, the most waits) when the other tenants have enough outcomes of their own (`contest_min`) to say how
things are for them. A fault that hits everyone fails or delays the others too, and shows; the only tenant, and
tenant "" (the gateway's own calls: probes, shadows), count as usual, and "" is never left out.

Tenants acting together. Leaving out only the dominant one, two attackers taking turns kept the signal: each one's
failures stayed in what the other was left out of. So besides the dominant tenant, `left_out` leaves out the next
worst (by the same ranking), each with `contest_min` outcomes of its own in the window, the rest keeping
`contest_min`, that *stand out*: a tenant's own rate of bad outcomes is more than GAP (twice) the rate of the rest
left without all of them (the ladder's waits: its p95 over the rest's, the caller's `stands_out`); one that does not
goes back into the rest, the least bad first, and the others are tested again. The bound: at most half of the named
tenants with outcomes in the window (at least the one, as with two tenants before) and at most CONTEST_MAX. Why:

- GAP: a fault that hits everyone gives every tenant about the same rate, so no one stands out and nothing more than
  the dominant tenant is left out, as before; only a coalition failing far more than the others is.
- `contest_min` outcomes of each member's own: with a few outcomes each, a fault at 50% makes half the tenants fail
  all of theirs and the other half none, which only looks like a coalition. (A breaker's run of consecutive failures
  is evidence of its own: `may_leave_out` judges the run's tenants without it.)
- half the tenants: the signal says how things are for most tenants; when most fail, it is the tier.

Not covered: a coalition of half the active tenants or more (two attackers beside one other tenant, three beside
one or two), or of more than CONTEST_MAX; members with fewer than `contest_min` outcomes each, whose failures count
(it takes many such tenants to move a rate, and then they are more than CONTEST_MAX); members outranked by more than
2 × bound tenants that fail more often by count (only those are tried); a coalition that fails no more than twice
the others' rate (then the others are failing too). A fault that hits only a few tenants' requests (their prompts,
their model) is left out as a coalition would be: the gateway cannot tell the two apart, as it cannot for one tenant.

`TenantCounts` keeps the counts as outcomes enter and leave the caller's window, O(1) each (every request adds one);
a decision (who is left out) costs one pass over the tenants in the window and O(CONTEST_MAX²) stand-out tests.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator

OUTCOMES, BAD = 0, 1  # what a tenant is ranked by: its outcomes (waits) or its bad ones (failures, 5xx)
CONTEST_MAX = 4  # the most tenants a signal leaves out together
GAP = 2.0  # a tenant stands out when its rate (or p95) is more than this times the rest's
StandsOut = Callable[[str, frozenset[str]], bool]  # (tenant, it and those left out with it): is it worse than the rest?


class TenantCounts:
    """Each tenant's outcomes and bad outcomes inside a window, and their totals. The caller keeps the window (its
    deque says which outcome leaves when) and tells each one entering (`add`) and leaving (`remove`)."""

    __slots__ = ("bad", "by_tenant", "n")

    def __init__(self) -> None:
        self.by_tenant: dict[str, list[int]] = {}  # tenant -> [outcomes, bad] in the window
        self.n = 0  # outcomes in the window
        self.bad = 0  # bad ones among them

    def add(self, tenant: str, bad: bool = False) -> None:
        counts = self.by_tenant.get(tenant)
        if counts is None:
            counts = self.by_tenant[tenant] = [0, 0]
        counts[OUTCOMES] += 1
        self.n += 1
        if bad:
            counts[BAD] += 1
            self.bad += 1

    def remove(self, tenant: str, bad: bool = False) -> None:
        counts = self.by_tenant[tenant]
        counts[OUTCOMES] -= 1
        self.n -= 1
        if bad:
            counts[BAD] -= 1
            self.bad -= 1
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

    def rate_of(self, tenant: str) -> float:
        n, bad = self.by_tenant.get(tenant, (0, 0))
        return bad / n if n else 0.0

    def named(self) -> int:
        """The tenants with outcomes in the window, "" (the gateway's own) not among them."""
        return len(self.by_tenant) - ("" in self.by_tenant)

    def copy(self) -> TenantCounts:
        other = TenantCounts()
        other.by_tenant = {t: list(c) for t, c in self.by_tenant.items()}
        other.n, other.bad = self.n, self.bad
        return other


def bound(counts: TenantCounts) -> int:
    """The most tenants left out together: half the named tenants in the window (at least 1), at most CONTEST_MAX."""
    return max(1, min(CONTEST_MAX, counts.named() // 2))


def rate_stands_out(counts: TenantCounts) -> StandsOut:
    """A tenant stands out when its rate of bad outcomes is more than GAP times the rest's (without `left`)."""
    return lambda tenant, left: counts.rate_of(tenant) > GAP * counts.rate_without(left)


def left_out(counts: TenantCounts, contest_min: int, *, by: int = BAD,
             stands_out: StandsOut | None = None) -> frozenset[str]:
    """The tenants the signal leaves out: the one with the most bad outcomes (`by=BAD`) or the most outcomes
    (`by=OUTCOMES`), when it is not "" and the others have at least `contest_min` outcomes in the window; with it, the
    next worst with `contest_min` outcomes of their own, the rest keeping `contest_min`, up to `bound` tenants in all,
    that stand out of the rest left (`stands_out`, by default `rate_stands_out`). Empty: the signal counts everyone."""
    if not counts.by_tenant:
        return frozenset()
    top, own = max(counts.by_tenant.items(), key=lambda kv: kv[1][by])
    rest = counts.n - own[OUTCOMES]
    if not top or rest < contest_min:
        return frozenset()
    chosen, most = [top], bound(counts)
    for tenant in heapq.nlargest(2 * most, (t for t in counts.by_tenant if t and t != top),
                                 key=lambda t: counts.by_tenant[t][by]):
        if len(chosen) == most:
            break
        n = counts.by_tenant[tenant][OUTCOMES]
        if n >= contest_min and rest - n >= contest_min:
            chosen.append(tenant)
            rest -= n
    stands_out = stands_out or rate_stands_out(counts)
    while len(chosen) > 1:  # each beside the dominant one stands out of the rest left without them all
        left = frozenset(chosen)
        alike = [t for t in chosen[1:] if not stands_out(t, left)]
        if not alike:
            break
        chosen.remove(alike[-1])  # the least bad first: the rest gets worse, and the next test is against that
    return frozenset(chosen)


def may_leave_out(counts: TenantCounts, tenants: Collection[str], contest_min: int, *,
                  stands_out: StandsOut | None = None) -> bool:
    """May the signal leave `tenants` out, the caller having evidence of its own that the outcomes are theirs (a
    breaker's run of consecutive failures): all named, at most `bound`, the rest keeping `contest_min` outcomes, and
    with more than one, each standing out of the rest (`stands_out`, by default `rate_stands_out`)."""
    if not tenants or "" in tenants or len(tenants) > bound(counts) or counts.without(tenants)[0] < contest_min:
        return False
    if len(tenants) == 1:
        return True
    left = frozenset(tenants)
    stands_out = stands_out or rate_stands_out(counts)
    return all(stands_out(tenant, left) for tenant in left)
