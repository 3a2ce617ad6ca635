"""A shadow cannot be paused (it answers no tenant from the candidate: nothing to hold), and a plain promote never
sends a paused shadow (one stored before that refusal) to everyone."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import Conflict
from gateway.rollout.service import RolloutService
from gateway.rollout.state import RolloutEvent, SqliteRolloutStore
from tiers.catalogue import TierCatalogue

TIER = {"backend": "openai", "model": "m", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
        "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}
MID = TIER | {"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "urls": ["http://b:1"]}]}
CATALOGUE = TierCatalogue.model_validate({"tiers": {"mid": MID}})


def test_pausing_a_shadow_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    s = RolloutService(CATALOGUE, SqliteRolloutStore(tmp_path / "s.db"))
    s.start("mid", "v2", share=0, shadow=0.5, who="op", reason="shadow")
    with pytest.raises(Conflict) as refused:
        s.pause("mid", who="op", reason="hold the shadow")
    err = refused.value
    assert (err.status_code, err.code) == (409, "shadow_not_pausable")
    assert "roll it back" in err.message and "promote it with a share" in err.message
    assert s.status()[0]["stage"] == "shadow" and [e.action for e in s.history("mid")] == ["start"]
    assert any(s.shadow_of(CATALOGUE.tiers["mid"], f"req{i}") for i in range(100))  # its copies go on


def test_a_paused_shadow_is_not_promoted_to_full(tmp_path: Path) -> None:
    store = SqliteRolloutStore(tmp_path / "s.db")
    s = RolloutService(CATALOGUE, store)
    r = s.start("mid", "v2", share=0, shadow=0.5, who="op", reason="shadow")
    paused = r.changed(stage="paused", who="op", reason="stored before pause refused shadows", now=r.changed_at + 1)
    assert store.save(paused, RolloutEvent.of("pause", paused))
    with pytest.raises(Conflict) as refused:
        s.promote("mid", who="op", reason="resume?")
    assert refused.value.code == "paused_shadow"
    assert s.status()[0]["stage"] == "paused"
    canary = s.promote("mid", share=0.1, who="op", reason="a small canary first")  # with a share, as any canary
    assert (canary.stage, canary.share) == ("canary", 0.1)
