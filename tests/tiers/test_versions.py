"""Versions of a tier in tiers.yaml: each inherits the tier's fields and changes some; `serving` answers today."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.fleet import Fleet

MID: dict[str, Any] = {"backend": "openai", "model": "m1", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
                       "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}


def catalogue(**mid: Any) -> TierCatalogue:
    return TierCatalogue.model_validate({"tiers": {"mid": MID | mid}})


def test_a_version_inherits_the_tier_and_the_tier_is_its_serving_version() -> None:
    c = catalogue(serving="v2", versions=[{"name": "v1"}, {"name": "v2", "model": "m2", "urls": ["http://b:1"],
                                                           "quantize": "int8"}])
    mid = c.tiers["mid"]
    assert (mid.version_name, mid.model, mid.urls, mid.quantize) == ("v2", "m2", ["http://b:1"], "int8")
    v1 = mid.variant("v1")
    assert (v1.name, v1.version_name, v1.model, v1.urls, v1.quantize) == ("mid", "v1", "m1", ["http://a:1"], None)
    assert v1.price_per_1k_output == mid.price_per_1k_output and v1.context_limit == 4096
    assert set(mid.variants) == {"v1", "v2"} and mid.variant("v2") is mid


def test_a_tier_without_versions_is_as_before() -> None:
    mid = catalogue().tiers["mid"]
    assert mid.version_name is None and mid.variants == {} and mid.model == "m1"


@pytest.mark.parametrize(("mid", "message"), [
    ({"serving": "v3", "versions": [{"name": "v1"}, {"name": "v2"}]}, "serving: 'v3' is not one of"),
    ({"versions": [{"name": "v1"}]}, "names the one answering today in `serving`"),
    ({"serving": "v1", "versions": [{"name": "v1"}, {"name": "v1", "model": "x"}]}, "duplicate name(s) v1"),
    ({"serving": "v1"}, "this tier lists none"),
    ({"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "urls": []}]}, "version 'v2': "),
    ({"serving": "v1", "versions": [{"name": "v1", "price_per_1k_input": "1"}]}, "price_per_1k_input"),
    ({"serving": "v1", "versions": [{"name": "bad name"}]}, "name"),
    ({"backend": "local", "urls": [], "serving": "v1", "versions": [{"name": "v1"}]}, "local tier"),
])
def test_bad_versions_are_refused_with_a_clear_error(mid: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as exc:
        catalogue(**mid)
    assert message in str(exc.value)


def test_each_version_has_its_own_replicas_and_model_version(tmp_path: Path) -> None:
    c = catalogue(serving="v1", versions=[{"name": "v1"}, {"name": "v2", "urls": ["http://b:1", "http://b:2"]}])
    fleet = Fleet(c, TierClient(), models_dir=tmp_path, log_dir=tmp_path, core_budget=None)
    mid, v2 = c.tiers["mid"], c.tiers["mid"].variant("v2")
    assert [r.url for r in fleet.replicas_of(mid)] == ["http://a:1"]
    assert [r.url for r in fleet.replicas_of(v2)] == ["http://b:1", "http://b:2"]
    assert fleet.model_version(mid) != fleet.model_version(v2)  # the cache scope keys on it: no hit crosses versions
    for rep in fleet.replicas_of(mid) + fleet.replicas_of(v2):
        rep.mark("ready", "")
    assert fleet.pick("mid", version="v2")[0].url.startswith("http://b:")
    assert fleet.pick("mid")[0].url == "http://a:1"
    assert set(fleet.status()["mid"]["versions"]) == {"v1", "v2"}
    assert fleet.model_version(catalogue().tiers["mid"]) == "openai:m1:none:auto"  # unchanged without versions
