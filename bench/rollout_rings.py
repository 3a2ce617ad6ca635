"""What recording one rollout outcome costs (gateway/rollout/rings.py `Rings.append`, on the event loop for every
request a rollout sees), beside the scan it replaced, in one run.

    .venv/bin/python -m bench.rollout_rings [--repeat 5]

A full window (4,096 outcomes) under three tenant mixes, µs per append (best of `--repeat` runs):
- hostile: one tenant holds most of the window and 1,096 others one outcome each, each appending below the average
  share, so each append takes the largest ring's oldest (the scan looked at every tenant);
- flood: one tenant appends over a window shared with 50 others (its own oldest goes: no scan before or after);
- even: 50 tenants in turn.
"""

from __future__ import annotations

import argparse
import platform
import timeit
from collections import deque
from collections.abc import Callable

from bench.structured_output import cpu_model
from gateway.rollout.guards import MAX_SAMPLES
from gateway.rollout.rings import Rings, Tenant


class ScanRings:
    """The rings before: past the bound, a tenant at or below the average share scanned every ring for the largest."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._rings: dict[Tenant, deque[int]] = {}
        self._size = 0

    def append(self, tenant: Tenant, item: int) -> None:
        ring = self._rings.get(tenant)
        if ring is None:
            ring = self._rings[tenant] = deque()
        ring.append(item)
        self._size += 1
        if self._size <= self.bound:
            return
        owner = tenant
        if len(ring) * len(self._rings) <= self._size:
            owner = max(self._rings, key=lambda t: len(self._rings[t]))
            ring = self._rings[owner]
        ring.popleft()
        self._size -= 1
        if not ring:
            del self._rings[owner]


MIXES: dict[str, tuple[list[Tenant], list[Tenant]]] = {  # what fills the window, then who appends, in turn
    "hostile": (["heavy"] * (MAX_SAMPLES - 1096) + [f"t{i}" for i in range(1096)], [f"t{i}" for i in range(1096)]),
    "flood": ([f"t{i % 50}" for i in range(MAX_SAMPLES)], ["flood"]),
    "even": ([f"t{i % 50}" for i in range(MAX_SAMPLES)], [f"t{i}" for i in range(50)]),
}


def per_append_us(make: Callable[[int], Rings[int] | ScanRings], mix: str, repeat: int, number: int = 2000) -> float:
    fill, appenders = MIXES[mix]
    best = float("inf")
    for _ in range(repeat):
        rings = make(MAX_SAMPLES)
        for i, tenant in enumerate(fill):
            rings.append(tenant, i)
        calls = [(appenders[i % len(appenders)], i) for i in range(number)]
        start = timeit.default_timer()
        for tenant, i in calls:
            rings.append(tenant, i)
        best = min(best, timeit.default_timer() - start)
    return best / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"`python -m bench.rollout_rings --repeat {args.repeat}` — {cpu_model()}; Python "
          f"{platform.python_version()}\n")
    print("| mix | scan (µs/append) | heap (µs/append) |\n|---|---:|---:|")
    for mix in MIXES:
        print(f"| {mix} | {per_append_us(ScanRings, mix, args.repeat):.2f} | "
              f"{per_append_us(Rings, mix, args.repeat):.2f} |")


if __name__ == "__main__":
    main()
