"""A rollout window's rings (gateway/rollout/rings.py) keep and evict exactly what a plain scan for the largest ring
would, and no longer scan the tenants on an append: a hostile mix of many tenants, each below the average share,
made every append on the event loop one step per tenant (up to 4,096 of them)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from gateway.rollout.rings import Rings, Tenant


class Reference:
    """The rule stated plainly: past the bound, a tenant above the average gives up its own oldest, else the largest
    ring (the first made among equals) gives up its oldest."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.rings: dict[Tenant, deque[int]] = {}

    def append(self, tenant: Tenant, item: int) -> None:
        self.rings.setdefault(tenant, deque()).append(item)
        size = sum(len(r) for r in self.rings.values())
        if size <= self.bound:
            return
        owner = tenant
        if len(self.rings[tenant]) * len(self.rings) <= size:
            owner = max(self.rings, key=lambda t: len(self.rings[t]))
        self.rings[owner].popleft()
        if not self.rings[owner]:
            del self.rings[owner]

    def items(self) -> list[int]:
        return [item for ring in self.rings.values() for item in ring]


@pytest.mark.parametrize("seed", range(12))
def test_the_rings_keep_what_the_plain_rule_keeps(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.choice([1, 2, 5, 17, 64, 200])
    # a few heavy tenants and a long tail of light ones (rings emptied and made again), the gateway's own (None)
    names: list[Tenant] = [None, *(f"t{i}" for i in range(rng.choice([3, 30, 300])))]
    weights = [rng.paretovariate(1.0) for _ in names]
    rings: Rings[int] = Rings(bound)
    reference = Reference(bound)
    for item in range(4000):
        tenant = rng.choices(names, weights)[0] if rng.random() < 0.8 else rng.choice(names)
        rings.append(tenant, item)
        reference.append(tenant, item)
        assert rings.items() == reference.items(), (seed, item)


class Name(str):
    """A tenant's name that counts how often it is hashed (each dict lookup of it hashes it once)."""

    hashed = 0

    def __hash__(self) -> int:
        Name.hashed += 1
        return str.__hash__(self)


def test_an_append_does_not_scan_the_tenants() -> None:
    bound, light = 4096, 1096
    rings: Rings[int] = Rings(bound)
    heavy, names = Name("heavy"), [Name(f"tenant-{i}") for i in range(light)]
    for i in range(bound - light):  # one tenant holds most of the window, the many others one outcome each
        rings.append(heavy, i)
    for i, name in enumerate(names):
        rings.append(name, bound - light + i)
    Name.hashed = 0
    appends = 2000
    for i in range(appends):  # each light tenant stays below the average: the largest ring (heavy's) gives way
        rings.append(names[i % light], bound + i)
    kept = rings.items()
    assert len(kept) == bound and kept[:bound - light - appends] == list(range(appends, bound - light))
    # a scan for the largest ring looks each of the 1,097 tenants up: over 2 million hashes here
    assert Name.hashed < 10 * appends, Name.hashed
