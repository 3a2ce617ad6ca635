"""A quantile of a window without some tenants' samples (gateway/quantiles.py), against filtering and sorting."""

from __future__ import annotations

import random

from gateway.quantiles import kth_without


def test_the_kth_without_some_tenants_is_the_kth_of_the_others() -> None:
    rng = random.Random(11)
    for _ in range(500):
        samples = [(round(rng.random(), 1), rng.choice("abcd")) for _ in range(rng.randint(1, 50))]
        ordered = sorted(v for v, _ in samples)
        own = {t: sorted(v for v, who in samples if who == t) for t in "abcd"}
        gone = rng.sample("abcd", rng.randint(0, 3))
        left = sorted(v for v, t in samples if t not in gone)
        if not left:
            continue
        k = rng.randint(1, len(left))
        assert kth_without(ordered, [own[t] for t in gone], k) == left[k - 1]
