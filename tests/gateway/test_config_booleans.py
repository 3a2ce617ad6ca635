"""YAML's `true` and `false` are no numbers in the configuration files: pydantic's lax mode read them as 1 and 0, so
`replicas: true` was one replica, `cap_output_tokens: true` one-token answers and `level: false` level 0. Each is
refused with the file, the line and the field; numbers as the files give them today (a quoted "2" included) and the
fields that are bools keep working."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config_files import ConfigFileError, load_yaml
from gateway.ladder.config import Ladder
from gateway.settings import REPO_ROOT
from quotas.plans import PlanBook
from tiers.catalogue import TierCatalogue

TIERS, PLANS = REPO_ROOT / "tiers" / "tiers.yaml", REPO_ROOT / "quotas" / "plans.yaml"
LADDER = REPO_ROOT / "degrade_ladder.yaml"
MODEL = {TIERS: TierCatalogue, PLANS: PlanBook, LADDER: Ladder}
CASES = [  # (file, where in it, the value set there, what the refusal names)
    (TIERS, ("tiers", "mid", "replicas"), True, "tiers.mid.replicas"),
    (TIERS, ("tiers", "mid", "context_limit"), False, "tiers.mid.context_limit"),
    (TIERS, ("tiers", "mid", "max_concurrency"), True, "tiers.mid.max_concurrency"),
    (TIERS, ("tiers", "mid", "max_num_seqs"), True, "tiers.mid.max_num_seqs"),
    (TIERS, ("tiers", "mid", "threads"), True, "tiers.mid.threads"),
    (TIERS, ("tiers", "mid", "cores"), True, "tiers.mid.cores"),
    (TIERS, ("tiers", "mid", "price_per_1k_input"), True, "tiers.mid.price_per_1k_input"),
    (TIERS, ("tiers", "small", "distill", "layers"), True, "tiers.small.distill.layers"),
    (TIERS, ("tiers", "full", "speculative", "k"), True, "tiers.full.speculative.k"),
    (TIERS, ("tiers", "mid", "rollout_guards"), {"min_requests": True}, "tiers.mid.rollout_guards: min_requests"),
    (TIERS, ("embeddings", "price_per_1k_input"), True, "embeddings.price_per_1k_input"),
    (PLANS, ("plans", "free", "max_queue_wait_s"), True, "plans.free.max_queue_wait_s"),
    (PLANS, ("plans", "free", "weight"), True, "plans.free.weight"),
    (PLANS, ("plans", "free", "idempotency_ttl_s"), True, "plans.free.idempotency_ttl_s"),
    (PLANS, ("plans", "free", "routing", "quality_floor"), True, "plans.free.routing.quality_floor"),
    (PLANS, ("plans", "free", "cache", "similarity_threshold"), True, "plans.free.cache.similarity_threshold"),
    (PLANS, ("plans", "free", "cache", "ttl_s"), True, "plans.free.cache.ttl_s"),
    (PLANS, ("plans", "free", "limits", "rpm"), True, "plans.free.limits.rpm"),
    (PLANS, ("plans", "free", "limits", "budget_day_usd"), True, "plans.free.limits.budget_day_usd"),
    (LADDER, ("levels", 1, "actions", 1, "cap_output_tokens"), True, "cap_output_tokens"),
    (LADDER, ("levels", 2, "actions", 2, "cap_input_tokens"), True, "cap_input_tokens"),
    (LADDER, ("levels", 1, "level"), True, "levels.1.level"),
    (LADDER, ("levels", 1, "min_dwell_s"), True, "levels.1.min_dwell_s"),
    (LADDER, ("levels", 1, "enter", "for_s"), True, "levels.1.enter.for_s"),
    (LADDER, ("levels", 1, "enter", "any", 0, "above"), True, "levels.1.enter.any.0.above"),
]


def write_with(tmp_path: Path, shipped: Path, where: tuple[Any, ...], value: object) -> tuple[Path, int]:
    """The shipped file with `value` set at `where`, written one key a line; and the line of that key."""
    data = yaml.safe_load(shipped.read_text())
    node = data
    for key in where[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    node[where[-1]] = value
    f = tmp_path / shipped.name
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    f.write_text(text)
    return f, _line(text, where)


def _line(text: str, where: tuple[Any, ...]) -> int:
    """The 1-based line where the key `where` ends in is written (as safe_dump writes it: mappings in blocks)."""
    node = yaml.compose(text)
    line = 0
    for key in where:
        if isinstance(node, yaml.MappingNode):
            k, node = next((k, v) for k, v in node.value if k.value == str(key))
            line = k.start_mark.line + 1
        else:
            node = node.value[key]
            line = node.start_mark.line + 1
    return line


@pytest.mark.parametrize(("shipped", "where", "value", "named"), CASES,
                         ids=[f"{s.name}:{'.'.join(map(str, w))}" for s, w, _, _ in CASES])
def test_a_boolean_for_a_number_is_refused_naming_the_file_line_and_field(
        tmp_path: Path, shipped: Path, where: tuple[Any, ...], value: object, named: str) -> None:
    f, line = write_with(tmp_path, shipped, where, value)
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, MODEL[shipped], context={"tiers": {"small", "mid", "full"}} if shipped == PLANS else None)
    assert exc.value.path == f and exc.value.line == line, (exc.value.line, line, exc.value.reason)
    # a price was refused before too (pydantic's Decimal takes no bool), in pydantic's words
    assert named in exc.value.reason and ("not a boolean" in exc.value.reason or "Decimal input" in exc.value.reason)


def test_numbers_as_given_today_and_boolean_fields_are_still_taken(tmp_path: Path) -> None:
    f, _ = write_with(tmp_path, TIERS, ("tiers", "mid", "replicas"), "2")  # a quoted number, as lax mode reads it
    data = yaml.safe_load(f.read_text())
    data["tiers"]["mid"] |= {"tools": False, "cores": 2, "rollout_guards": {"min_requests": 20, "max_error_rate": 0.1}}
    f.write_text(yaml.safe_dump(data))
    mid = load_yaml(f, TierCatalogue).tiers["mid"]
    assert mid.replicas == 2 and mid.tools is False and mid.cores == 2.0
    assert mid.rollout_guards == {"min_requests": 20, "max_error_rate": 0.1}
    ladder = load_yaml(LADDER, Ladder)  # `disable_cascade: true` is a bool field
    assert any(getattr(a, "disable_cascade", False) is True for a in ladder.levels[2].actions)
    plans = load_yaml(PLANS, PlanBook, context={"tiers": {"small", "mid", "full"}})
    assert plans.plans["free"].allow_upgrade is True and plans.plans["free"].limits.rpm == 20
