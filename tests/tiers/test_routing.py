"""Routing rules: explicit tiers, `auto`, plan restrictions, fallback around unavailable tiers."""

from __future__ import annotations

import pytest

from gateway.config_files import load_yaml
from gateway.settings import REPO_ROOT
from tiers.catalogue import TierCatalogue
from tiers.errors import NoTierAvailable, TierNotAllowed, UnknownModel
from tiers.routing import choose_tier

CAT = load_yaml(REPO_ROOT / "tiers" / "tiers.yaml", TierCatalogue)
ALL = ["small", "mid", "full"]


def route(requested: str, *, allowed: list[str] = ALL, default: str = "mid", upgrade: bool = False,
          down: dict[str, str] | None = None) -> tuple[str, str]:
    r = choose_tier(requested, catalogue=CAT, allowed=allowed, default=default, allow_upgrade=upgrade,
                    unavailable=down or {})
    return r.tier.name, r.reason


def test_explicit_and_auto() -> None:
    assert route("full") == ("full", "requested")
    assert route("auto")[0] == "mid"
    with pytest.raises(TierNotAllowed):
        route("full", allowed=["small", "mid"])
    with pytest.raises(UnknownModel):
        route("gpt-4o")


def test_fallback_prefers_the_closest_cheaper_tier() -> None:
    name, reason = route("full", down={"full": "engine crashed"})
    assert name == "mid" and "full unavailable (engine crashed)" in reason
    assert route("full", down={"full": "x", "mid": "y"})[0] == "small"


def test_upgrade_only_where_the_plan_allows_it() -> None:
    with pytest.raises(NoTierAvailable) as exc:
        route("small", down={"small": "not built"})
    assert "not built" in str(exc.value)
    assert route("small", upgrade=True, down={"small": "not built"})[0] == "mid"
    assert route("small", upgrade=True, allowed=["small", "full"], down={"small": "x"})[0] == "full"


def test_tiers_are_ordered_by_price() -> None:
    assert [t.name for t in CAT.by_price()] == ["small", "mid", "full"]
