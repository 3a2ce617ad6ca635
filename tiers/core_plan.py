"""How the local engines share the host's cores: the core budget, each replica's share of it, and the hardware
groups that sharing makes.

Co-located engines share one core budget. The budget is every CPU the gateway may run on
(`os.sched_getaffinity`), less TIERGATE_GATEWAY_CORES kept for the gateway itself (default: none below 4
CPUs, where one would cost the engines half or a third of the machine; one from 4 up, so the gateway's event
loop never waits behind an engine's spinning threads). `plan_cores` splits it among the local replicas by
each tier's `cores` weight into disjoint core sets; each engine runs pinned to its set with as many threads
as it has cores. With more replicas than cores, replicas share cores (one thread each), and the log and
/health say which. Tiers whose engines share cores form a hardware group: the router sheds an overloaded
tier's requests only to a tier outside its group, because moving work onto the same cores adds no capacity.
TIERGATE_CORE_BUDGET=off starts engines unpinned with torch's own thread counts (every local tier then shares
every core: one group).

These are pure functions of the tiers, the replicas and the CPUs (and the two settings above), apart from the
engines they plan for: the fleet (tiers/fleet.py) plans with them once, when it is made, and the workers of
`tiergate serve --workers N` (gateway/workers.py) size the parent's budget with `host_core_budget`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from tiers.catalogue import TierSpec
from tiers.supervisor import CoreShare

CORE_BUDGET_ON = ("on", "1", "true", "yes", "")  # TIERGATE_CORE_BUDGET's words (gateway/settings.py checks them)
CORE_BUDGET_OFF = ("off", "0", "false", "no")
SHARED_HOST = "cpu:all"  # the hardware group of local CPU tiers when the core budget is off


def host_core_budget(cores: Sequence[int] | None = None, *, workers: int = 1) -> list[int] | None:
    """The CPUs local engines may share out (TIERGATE_CORE_BUDGET, TIERGATE_GATEWAY_CORES), or None when the
    budget is off. `cores`: the gateway's own CPUs [default: its affinity]; `workers`: its processes, each of which
    the default keeps a core for when there are several."""
    budget = os.environ.get("TIERGATE_CORE_BUDGET", "on").strip().lower()
    if budget in CORE_BUDGET_OFF:
        return None
    if budget not in CORE_BUDGET_ON:  # gateway/settings.py refuses it at start-up; never taken as on
        raise ValueError(f"TIERGATE_CORE_BUDGET is on or off (or 1/0, true/false, yes/no), not {budget!r}")
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    keep = os.environ.get("TIERGATE_GATEWAY_CORES", "").strip()
    if keep and not keep.isdigit():
        raise ValueError(f"TIERGATE_GATEWAY_CORES is the number of cores kept for the gateway, not {keep!r}")
    reserve = int(keep) if keep else workers if workers > 1 else (0 if len(cores) < 4 else 1)
    reserve = max(0, min(reserve, len(cores) - 1))  # the engines keep at least one
    return cores[reserve:]


def plan_cores(replicas: Sequence[tuple[str, float]], cores: Sequence[int]) -> list[CoreShare]:
    """Each replica's share of `cores`, in order. `replicas`: (label, weight), first the one that should keep
    its cores to itself when there are more replicas than cores (the fleet puts the dearest tier first).

    Up to one replica per core: disjoint, contiguous sets sized by weight (largest remainder, at least one
    core each). More replicas than cores: consecutive replicas share one core each, in groups whose sizes
    differ by at most one, the larger groups last (the cheapest tiers)."""
    n, c = len(replicas), len(cores)
    if n == 0:
        return []
    if n > c:
        shares: list[CoreShare] = []
        for j in range(c):
            start = j * (n // c) + max(0, j - (c - n % c))
            size = n // c + (1 if j >= c - n % c else 0)
            group = [label for label, _ in replicas[start:start + size]]
            shares += [CoreShare((cores[j],), 1, tuple(g for g in group if g != label)) for label in group]
        return shares
    total = sum(w for _, w in replicas)
    ideal = [c * w / total for _, w in replicas]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > c:  # the at-least-one rule overspent: take from whoever got most over their ideal
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - ideal[i])
        counts[i] -= 1
    while sum(counts) < c:  # hand out what rounding down left, furthest below its ideal first
        i = max(range(n), key=lambda i: (ideal[i] - counts[i], -i))
        counts[i] += 1
    shares, start = [], 0
    for count in counts:
        shares.append(CoreShare(tuple(cores[start:start + count]), count))
        start += count
    return shares


def hardware_groups(specs: Iterable[TierSpec], core_shares: Mapping[tuple[str, int], CoreShare],
                    tier_of: Mapping[str, str], *, budgeted: bool) -> dict[str, str]:
    """Local tier -> its hardware group: tiers whose engines (any version's) share cores (or a device) are in
    one. `specs`: every tier (the local ones are grouped); `core_shares`: (replica label, index) -> its share, as
    `plan_cores` made them; `tier_of`: replica label -> its tier; `budgeted`: whether there is a core budget (without
    one every local CPU tier shares every core: SHARED_HOST)."""
    local = [spec for spec in specs if spec.backend == "local"]
    groups = {spec.name: f"device:{spec.device}" for spec in local if spec.device != "cpu"}
    cpu = [spec.name for spec in local if spec.device == "cpu"]
    if not budgeted:
        return groups | dict.fromkeys(cpu, SHARED_HOST)
    parent = {name: name for name in cpu}  # union-find over tiers with a core in common

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    owner: dict[int, str] = {}
    for (label, _), share in core_shares.items():
        tier = tier_of[label]
        if tier not in parent:
            continue
        for core in share.cores:
            if core in owner:
                parent[root(tier)] = root(owner[core])
            owner.setdefault(core, tier)
    members: dict[str, list[str]] = {}
    for name in cpu:
        members.setdefault(root(name), []).append(name)
    return groups | {name: "cpu:" + "+".join(sorted(members[root(name)])) for name in cpu}
