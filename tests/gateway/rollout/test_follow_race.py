"""`follow` (a worker thread) reads the store, then takes what it read: a change this process saved in between
(an admin's rollback) is newer than that read and stays, not undone here until the next follow."""

from __future__ import annotations

import threading
from pathlib import Path

from gateway.rollout.service import RolloutService
from gateway.rollout.state import Rollout, SqliteRolloutStore
from tiers.catalogue import TierCatalogue

TIER = {"backend": "openai", "model": "m", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
        "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}
MID = TIER | {"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "urls": ["http://b:1"]}]}
CATALOGUE = TierCatalogue.model_validate({"tiers": {"mid": MID}})


class HeldRead(SqliteRolloutStore):
    """A store whose load, in the thread named `follower`, waits after reading until told to go on."""

    read = threading.Event()
    go = threading.Event()

    def load(self) -> dict[str, Rollout]:
        got = super().load()
        if threading.current_thread().name == "follower":
            self.read.set()
            assert self.go.wait(10)
        return got


def test_a_rollback_saved_while_follow_reads_is_not_undone(tmp_path: Path) -> None:
    store = HeldRead(tmp_path / "s.db")
    s = RolloutService(CATALOGUE, store)
    s.start("mid", "v2", share=1.0, who="op", reason="canary")
    follower = threading.Thread(target=s.follow, name="follower")
    follower.start()
    assert store.read.wait(10)  # the follower holds its read of the running canary
    assert s.rollback("mid", who="op", reason="bad candidate").stage == "rolled_back"
    store.go.set()
    follower.join(10)
    spec, why = s.choose(CATALOGUE.tiers["mid"], "acme", lambda: "c1")
    assert (spec.version_name, s.status()[0]["stage"]) == ("v1", "rolled_back"), why
    s.follow()  # a later read takes the store's newer state as before
    assert s.status()[0]["stage"] == "rolled_back"


def test_follow_takes_another_process_change(tmp_path: Path) -> None:
    store = SqliteRolloutStore(tmp_path / "s.db")
    s, other = RolloutService(CATALOGUE, store), RolloutService(CATALOGUE, store)
    s.start("mid", "v2", share=0.5, who="op", reason="canary")
    other.follow()
    other.promote("mid", share=0.8, who="cli", reason="more")
    s.follow()
    assert (s.status()[0]["stage"], s.status()[0]["share"]) == ("canary", 0.8)
