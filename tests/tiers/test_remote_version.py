"""A remote tier's model version (tiers/fleet.py `declared_version`, through `Fleet.model_version`) names the
deployment, not only the model: two tiers that declare the same model at other servers may answer differently (an
fp8 and a bf16 deployment), so they never share a cache scope; the same deployment keeps one version however its
URLs are listed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet

TIER: dict[str, Any] = {"backend": "openai", "model": "llama", "price_per_1k_input": "0.001",
                        "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}


def versions(tmp_path: Path, **urls: list[str]) -> dict[str, str]:
    cat = TierCatalogue.model_validate({"tiers": {name: TIER | {"urls": u} for name, u in urls.items()}})
    fleet = Fleet(cat, TierClient(), models_dir=tmp_path, log_dir=tmp_path, core_budget=None)
    return {name: fleet.model_version(spec) for name, spec in cat.tiers.items()}


def test_tiers_naming_one_model_at_other_deployments_do_not_share_a_version(tmp_path: Path) -> None:
    v = versions(tmp_path, mid=["http://fp8:8000"], full=["http://bf16:8000"])
    assert v["mid"] != v["full"]


def test_two_tiers_at_one_url_do_not_share_a_version_either(tmp_path: Path) -> None:
    v = versions(tmp_path, small=["http://a:1"], mid=["http://a:1"])
    assert v["small"] != v["mid"]


def test_a_deployment_keeps_its_version_however_its_urls_are_listed(tmp_path: Path) -> None:
    one = versions(tmp_path, mid=["http://a:1", "http://b:1/"])["mid"]
    assert versions(tmp_path, mid=["http://b:1", "http://a:1"])["mid"] == one
    assert versions(tmp_path, mid=["http://a:1", "http://c:1"])["mid"] != one  # another set of servers


def test_no_url_lands_in_the_version(tmp_path: Path) -> None:
    # (a URL with credentials is refused when the catalogue loads: tests/tiers/test_tier_url_secrets.py)
    v = versions(tmp_path, mid=["http://inference.internal:8000/v1"])["mid"]
    assert "inference" not in v and "8000" not in v and v.startswith("openai:llama:none:auto:mid:")
