"""A plan's numbers besides its limits are finite and bounded (quotas/plans.py), refused at load with the file, line
and key: each of these was taken, a "never" or an "always" in disguise. A weight of 1e300 counted the tenant's tokens
as near none in the fair share (first in its class, as `.inf` was), 1e-300 as near infinite; a cache TTL or a queue
wait of `.inf` or 1e300 is no expiry, no limit (null says that); a hit price of 1e300 a dollar amount no counter
holds; a cascade's `-.inf` logprob never retries."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config_files import ConfigFileError, load_yaml
from quotas.plans import MAX_CACHE_TTL_S, MAX_HIT_PRICE_PER_1K_USD, MAX_QUEUE_WAIT_S, MAX_WEIGHT, MIN_WEIGHT, PlanBook

# (a section of plan `p`, or "" for the plan itself; the key; what is refused; the largest or smallest that is taken)
NUMBERS = [
    ("", "weight", "1e300", MAX_WEIGHT), ("", "weight", "1e-300", MIN_WEIGHT), ("", "weight", "0.001", MIN_WEIGHT),
    ("", "max_queue_wait_s", ".inf", MAX_QUEUE_WAIT_S), ("", "max_queue_wait_s", "1e300", MAX_QUEUE_WAIT_S),
    ("cache", "ttl_s", ".inf", MAX_CACHE_TTL_S), ("cache", "ttl_s", "1.0e+300", MAX_CACHE_TTL_S),
    ("cache", "hit_price_per_1k", "1.0e+300", MAX_HIT_PRICE_PER_1K_USD),
    ("cache", "hit_price_per_1k", '"10.01"', MAX_HIT_PRICE_PER_1K_USD),
    ("routing", "cascade_min_mean_logprob", "-.inf", -1e300),
]


def _plans(tmp_path: Path, section: str, key: str, value: object) -> Path:
    f = tmp_path / "plans.yaml"
    setting = f"{key}: {value}" if not section else f"{section}: {{{key}: {value}}}"
    f.write_text(f"default_plan: p\nplans:\n  p:\n    allowed_tiers: [mid]\n    default_tier: mid\n    {setting}\n")
    return f


@pytest.mark.parametrize(("section", "key", "given", "bound"), NUMBERS)
def test_a_plan_number_out_of_its_bounds_is_refused_at_load(tmp_path: Path, section: str, key: str, given: str,
                                                           bound: object) -> None:
    f = _plans(tmp_path, section, key, given)
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, PlanBook)
    where = ".".join(part for part in ("plans.p", section, key) if part)
    assert exc.value.path == f and exc.value.line == 6 and exc.value.reason.startswith(f"{where}: "), exc.value


@pytest.mark.parametrize(("section", "key", "given", "bound"), NUMBERS)
def test_a_plan_number_at_its_bound_is_taken(tmp_path: Path, section: str, key: str, given: str,
                                            bound: object) -> None:
    plan = load_yaml(_plans(tmp_path, section, key, bound), PlanBook).plans["p"]
    assert getattr(getattr(plan, section) if section else plan, key) == bound
