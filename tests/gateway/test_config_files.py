"""Bad configuration files stop start-up with the file, the line and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.app import create_app, load_config
from gateway.config_files import ConfigFileError, load_yaml
from gateway.ladder.config import Ladder
from gateway.settings import REPO_ROOT, Settings
from quotas.plans import PlanBook
from tiers.catalogue import TierCatalogue


def test_shipped_files_are_valid() -> None:
    catalogue, plans = load_config(Settings())
    assert set(catalogue.tiers) == {"small", "mid", "full"}
    assert catalogue.tiers["mid"].quantize == "int8" and catalogue.tiers["full"].quantize is None
    assert plans.plans["standard"].default_tier in catalogue.tiers
    assert str(catalogue.tiers["full"].price_per_1k_output) == "0.0006"


def test_broken_yaml_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "tiers.yaml"
    f.write_text("tiers:\n  mid:\n    backend: local\n   model: [oops\n")
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, TierCatalogue)
    assert exc.value.path == f and exc.value.line == 4 and "YAML" in exc.value.reason


def test_schema_error_names_the_line_of_the_field(tmp_path: Path) -> None:
    text = (REPO_ROOT / "tiers" / "tiers.yaml").read_text().replace('price_per_1k_output: "0.0002"',
                                                                    'price_per_1k_output: "cheap"')
    f = tmp_path / "tiers.yaml"
    f.write_text(text)
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, TierCatalogue)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if '"cheap"' in s)
    assert exc.value.line == line and "tiers.mid.price_per_1k_output" in exc.value.reason
    assert f"{f}:{line}" in str(exc.value)


def test_plans_must_name_known_tiers_and_app_refuses_to_start(tmp_path: Path) -> None:
    f = tmp_path / "plans.yaml"
    f.write_text("default_plan: p\nplans:\n  p:\n    allowed_tiers: [mid, huge]\n    default_tier: mid\n")
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, PlanBook, context={"tiers": {"small", "mid", "full"}})
    assert "huge" in exc.value.reason
    with pytest.raises(ConfigFileError):
        create_app(Settings(data_dir=tmp_path / "d", plans_file=f))
    assert not (tmp_path / "d").exists()  # nothing was created


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(tmp_path / "nope.yaml", TierCatalogue)
    assert "cannot read" in exc.value.reason


def test_a_bad_rollout_guard_stops_the_app_naming_the_tier_and_field(tmp_path: Path) -> None:
    shipped = Path(Settings().tiers_file).read_text()
    f = tmp_path / "tiers.yaml"
    f.write_text(shipped.replace("  mid:\n", "  mid:\n    rollout_guards: {max_error_rate: 2}\n", 1))
    with pytest.raises(ConfigFileError) as exc:
        create_app(Settings(data_dir=tmp_path / "d", tiers_file=f))
    assert "tiers.mid.rollout_guards" in exc.value.reason and "max_error_rate" in exc.value.reason
    assert str(f) in str(exc.value) and not (tmp_path / "d").exists()  # nothing was created


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last of a repeated key without a word: a second `context_limit:`, or a second tier of one
    name, replaced the first."""
    shipped = (REPO_ROOT / "tiers" / "tiers.yaml").read_text()
    f = tmp_path / "tiers.yaml"
    f.write_text(shipped.replace("    context_limit: 8192\n", "    context_limit: 8192\n    context_limit: 512\n", 1))
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, TierCatalogue)
    first = shipped.splitlines().index("    context_limit: 8192") + 1
    assert exc.value.line == first + 1 and "'context_limit' is given twice" in exc.value.reason
    assert f"lines {first} and {first + 1}" in exc.value.reason
    plans = tmp_path / "plans.yaml"
    plans.write_text("default_plan: p\nplans:\n  p: {allowed_tiers: [mid], default_tier: mid}\n"
                     "  p: {allowed_tiers: [full], default_tier: full}\n")
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(plans, PlanBook)
    assert exc.value.line == 4 and "'p' is given twice" in exc.value.reason
    merged = tmp_path / "merged.yaml"  # YAML's merge key may be followed by the keys it does not replace
    merged.write_text("default_plan: p\nplans:\n  p: &p {allowed_tiers: [mid], default_tier: mid}\n"
                      "  q: {<<: *p, priority: batch}\n")
    assert load_yaml(merged, PlanBook).plans["q"].priority == "batch"


def test_a_huge_deep_or_binary_file_is_a_config_error_not_a_hang_or_a_crash(tmp_path: Path) -> None:
    shipped = (REPO_ROOT / "degrade_ladder.yaml").read_text()
    huge = tmp_path / "huge.yaml"
    huge.write_text(shipped + "#" * (2 << 20) + "\n")  # valid YAML, but 2 MiB is no one's ladder
    deep = tmp_path / "deep.yaml"
    deep.write_text("levels: " + "[" * 5000 + "]" * 5000 + "\n")  # past PyYAML's own recursion: no line
    deeper = tmp_path / "deeper.yaml"
    deeper.write_text("levels:\n" + "".join("  " * i + "- \n" for i in range(1, 100)))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"levels:\n  - {level: 0, name: \xff\xfe}\n")
    for path, line, reason in ((huge, None, "larger than 1048576 bytes"),
                               (Path("/dev/zero"), None, "larger than"),
                               (deep, None, "nested more than"), (deeper, 65, "nested more than"),
                               (binary, 2, "not UTF-8")):
        with pytest.raises(ConfigFileError) as exc:
            load_yaml(path, Ladder)
        assert exc.value.line == line and reason in exc.value.reason, (path, exc.value)


def test_a_plan_weight_is_finite(tmp_path: Path) -> None:
    """A weight of `.inf` counted none of the tenant's tokens in the fair share: always first in its class."""
    f = tmp_path / "plans.yaml"
    f.write_text("default_plan: p\nplans:\n  p:\n    allowed_tiers: [mid]\n    default_tier: mid\n    weight: .inf\n")
    with pytest.raises(ConfigFileError) as exc:
        load_yaml(f, PlanBook)
    assert exc.value.line == 6 and "plans.p.weight: Input should be a finite number" in exc.value.reason
