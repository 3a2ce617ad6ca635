"""The rollout rules on both stores (the data directory's SQLite file, the fleet's PostgreSQL): one rollout per
tier, each change audited with who and why, and refused changes leave nothing behind."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.errors import Conflict, InvalidRequest, NotFound, TiergateError, Unavailable
from gateway.rollout.service import RolloutService
from gateway.rollout.state import PostgresRolloutStore, RolloutEvent, RolloutStore, SqliteRolloutStore
from tiers.catalogue import TierCatalogue

TIER = {"backend": "openai", "model": "m", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
        "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}
MID = TIER | {"serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "urls": ["http://b:1"]},
                                          {"name": "v3", "urls": ["http://c:1"]}]}
CATALOGUE = TierCatalogue.model_validate({"tiers": {"mid": MID, "full": TIER}})


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RolloutStore]:
    s: RolloutStore = SqliteRolloutStore(tmp_path / "state.db") if request.param == "sqlite" else \
        PostgresRolloutStore(request.getfixturevalue("database_url"))
    yield s
    s.close()


def test_a_rollout_from_canary_to_full_then_the_next_one(store: RolloutStore) -> None:
    clock = iter(range(100, 200))
    s = RolloutService(CATALOGUE, store, clock=lambda: float(next(clock)))
    r = s.start("mid", "v2", share=0.2, tenants=("vip",), who="k1", reason="new weights")
    assert (r.stage, r.share, r.tenants, r.baseline, r.candidate) == ("canary", 0.2, ("vip",), "v1", "v2")
    s.promote("mid", share=0.5, who="k1", reason="looks fine")
    s.pause("mid", who="k2", reason="p95 up")
    s.promote("mid", who="k1", reason="p95 back")
    nxt = s.start("mid", "v3", share=0.1, who="cli", reason="next")  # `full` finished: v2 answers everyone
    assert nxt.baseline == "v2" and nxt.id != r.id
    s.rollback("mid", who="k2", reason="errors")
    other = RolloutService(CATALOGUE, store)  # another process (the CLI) reads the same
    assert [(x["tier"], x["stage"], x["baseline"]) for x in other.status()] == [("mid", "rolled_back", "v2")]
    trail = [(e.action, e.stage, e.share, e.who, e.reason) for e in other.history("mid")]
    assert trail == [("rollback", "rolled_back", 0.1, "k2", "errors"), ("start", "canary", 0.1, "cli", "next"),
                     ("promote", "full", 0.5, "k1", "p95 back"), ("pause", "paused", 0.5, "k2", "p95 up"),
                     ("promote", "canary", 0.5, "k1", "looks fine"), ("start", "canary", 0.2, "k1", "new weights")]
    assert other.history("full") == []


@pytest.mark.parametrize(("call", "error"), [
    (lambda s: s.start("nope", "v2", share=0.2, who="k", reason="r"), InvalidRequest),
    (lambda s: s.start("full", "v2", share=0.2, who="k", reason="r"), InvalidRequest),  # no versions
    (lambda s: s.start("mid", "v9", share=0.2, who="k", reason="r"), InvalidRequest),
    (lambda s: s.start("mid", "v1", share=0.2, who="k", reason="r"), Conflict),  # it answers already
    (lambda s: s.start("mid", "v3", share=0.2, who="k", reason="r"), Conflict),  # one at a time
    (lambda s: s.start("mid", "v2", share=1.5, who="k", reason="r"), InvalidRequest),
    (lambda s: s.promote("mid", share=0.1, who="k", reason="r"), InvalidRequest),  # would move conversations back
    (lambda s: s.promote("mid", who="k", reason="  "), InvalidRequest),
    (lambda s: s.pause("full", who="k", reason="r"), NotFound),
])
def test_refused_changes_leave_the_state_as_it_was(store: RolloutStore, call: object, error: type) -> None:
    s = RolloutService(CATALOGUE, store)
    s.start("mid", "v2", share=0.3, who="k", reason="r")
    before, trail = s.status(), s.history()
    with pytest.raises(error) as exc:
        call(s)  # type: ignore[operator]
    assert isinstance(exc.value, TiergateError) and exc.value.message
    assert (s.status(), s.history()) == (before, trail)


def test_two_changes_of_one_revision_cannot_both_win(store: RolloutStore) -> None:
    s = RolloutService(CATALOGUE, store)
    r = s.start("mid", "v2", share=0.3, who="k", reason="r")
    paused = r.changed(stage="paused", who="a", reason="x", now=r.changed_at + 1)
    full = r.changed(stage="full", who="b", reason="y", now=r.changed_at + 1)
    assert store.save(paused, RolloutEvent.of("pause", paused))
    assert not store.save(full, RolloutEvent.of("promote", full))  # written from the same revision: refused
    assert store.load()["mid"].stage == "paused"
    assert [e.action for e in store.history()] == ["pause", "start"]


def test_a_finished_rollout_cannot_be_paused_or_rolled_back_twice(store: RolloutStore) -> None:
    s = RolloutService(CATALOGUE, store)
    s.start("mid", "v2", share=0.3, who="k", reason="r")
    s.rollback("mid", who="k", reason="r")
    with pytest.raises(Conflict):
        s.rollback("mid", who="k", reason="again")
    with pytest.raises(Conflict):
        s.pause("mid", who="k", reason="r")


def test_a_tiers_rollout_guards_are_the_defaults_a_start_may_override(tmp_path: Path) -> None:
    from gateway.rollout.guards import Guards

    guards = {"max_error_rate": 0.01, "window_s": 600, "max_divergence": None}
    catalogue = TierCatalogue.model_validate({"tiers": {"mid": MID | {"rollout_guards": guards}}})
    store = SqliteRolloutStore(tmp_path / "state.db")
    try:
        s = RolloutService(catalogue, store)
        r = s.start("mid", "v2", share=0.2, who="k", reason="tier's guards")
        assert (r.guards.max_error_rate, r.guards.window_s, r.guards.min_requests) == (0.01, 600.0, 50)
        s.rollback("mid", who="k", reason="next")
        r = s.start("mid", "v3", share=0.2, who="k", reason="mine",
                    guards=Guards.model_validate({"window_s": 60.0}))
        assert (r.guards.max_error_rate, r.guards.window_s) == (0.01, 60.0)  # what the start set wins
    finally:
        store.close()


def test_a_bad_rollout_guard_in_the_tiers_file_stops_the_gateway_with_its_name(tmp_path: Path) -> None:
    catalogue = TierCatalogue.model_validate({"tiers": {"mid": MID | {"rollout_guards": {"max_eror_rate": 0.01}}}})
    store = SqliteRolloutStore(tmp_path / "state.db")
    try:
        with pytest.raises(ValueError, match=r"tiers.mid.rollout_guards: .*max_eror_rate"):
            RolloutService(catalogue, store)
    finally:
        store.close()


def test_a_start_refuses_a_candidate_that_takes_away_what_the_answering_version_offers(tmp_path: Path) -> None:
    """Under a vLLM tier: a plain `openai` version cannot sample by top_k, a `tools: false` one cannot call tools; a
    version that keeps both (another vLLM dialect) or adds one starts."""
    versions = [{"name": "v1"}, {"name": "openai", "dialect": "openai"}, {"name": "notools", "tools": False},
                {"name": "priority", "dialect": "vllm-priority"}]
    catalogue = TierCatalogue.model_validate({"tiers": {"mid": TIER | {"dialect": "vllm", "serving": "v1",
                                                                       "versions": versions}}})
    store = SqliteRolloutStore(tmp_path / "state.db")
    try:
        s = RolloutService(catalogue, store)
        for version, lost in (("openai", "top_k"), ("notools", "tools")):
            with pytest.raises(InvalidRequest, match=lost) as exc:
                s.start("mid", version, share=0.2, who="k", reason="r")
            assert (exc.value.param, exc.value.code) == ("version", "version_lacks_capability")
        assert s.status() == [] and s.history() == []
        s.start("mid", "priority", share=0.2, who="k", reason="r")
        s.promote("mid", who="k", reason="r")
        assert s.steady(catalogue.tiers["mid"]).version_name == "priority"  # the tier now offers what it has
        with pytest.raises(InvalidRequest, match="'priority'"):  # the version answering now is the baseline
            s.start("mid", "openai", share=0.2, who="k", reason="r")
    finally:
        store.close()


def test_a_candidate_lacking_a_need_passes_to_the_serving_version_when_its_baseline_is_gone(tmp_path: Path) -> None:
    """A rollout whose baseline the tiers file no longer declares, and whose candidate cannot do what a request
    needs (its file changed since the start): the request goes to the tier's serving version, which the route stage
    judged it by (`steady`). Before, with no baseline to pass it to, the candidate answered it anyway."""
    store = SqliteRolloutStore(tmp_path / "state.db")
    try:
        before = TierCatalogue.model_validate({"tiers": {"mid": TIER | {"serving": "v1", "versions": [
            {"name": "v1"}, {"name": "v2", "urls": ["http://b:1"]}]}}})
        RolloutService(before, store).start("mid", "v2", share=1.0, who="k", reason="r")
        after = TierCatalogue.model_validate({"tiers": {"mid": TIER | {"serving": "v3", "versions": [
            {"name": "v3", "urls": ["http://c:1"]}, {"name": "v2", "urls": ["http://b:1"], "tools": False}]}}})
        s, tier = RolloutService(after, store), after.tiers["mid"]
        assert s.steady(tier).version_name == "v3"
        lacks = {"v2": "tools"}.get
        plain, _ = s.choose(tier, "acme", lambda: "c1")
        assert plain.version_name == "v2"  # the canary takes what it can do
        spec, note = s.choose(tier, "acme", lambda: "c1", lacks=lambda v: lacks(v.version_name))
        assert spec.version_name == "v3" and "candidate v2: tools" in (note or "")
    finally:
        store.close()


def test_a_state_file_another_writer_holds_is_a_503_and_changes_nothing(tmp_path: Path) -> None:
    """The data directory's state file locked past its timeout (the CLI or another process writing, a disk that
    stalls) was a sqlite3 error, a 500 with a traceback; it is a retryable 503 in OpenAI's shape, nothing written."""
    path = tmp_path / "state.db"
    s = RolloutService(CATALOGUE, SqliteRolloutStore(path, timeout_s=0.05))
    s.start("mid", "v2", share=0.2, who="k", reason="canary")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        for change in (lambda: s.promote("mid", who="k", reason="all"), lambda: s.rollback("mid", who="k", reason="r")):
            with pytest.raises(Unavailable) as caught:
                change()
            err = caught.value
            assert (err.status_code, err.code, err.retry_after) == (503, "database_unavailable", 2)
            assert "another writer" in err.message and "nothing was changed" in err.message
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    other = RolloutService(CATALOGUE, SqliteRolloutStore(path))
    assert [(x["stage"], x["share"]) for x in other.status()] == [("canary", 0.2)]
    assert [e.action for e in other.history("mid")] == ["start"]
    assert s.promote("mid", who="k", reason="all").stage == "full"  # once the file is free again
