"""The cache loses the answers of a model version once no tier serves it (gateway/model_versions.py), keeps those of a
version served again, and, once every tier's version is known, those a gateway before a restart left of versions no
tier serves now."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cache import CacheStoreError, SemanticCache, SQLiteStore
from gateway.model_versions import ModelVersions
from tests.cache.conftest import chat, scope
from tests.cache.test_vectors_scope import CountingEmbedder


class Served:
    """What the tiers serve, set by the test: (versions, whether each is known)."""

    def __init__(self, *versions: str, known: bool = True) -> None:
        self.versions, self.known = set(versions), known

    def __call__(self) -> tuple[set[str], bool]:
        return set(self.versions), self.known


@pytest.fixture
def cache() -> Iterator[SemanticCache]:
    c = SemanticCache(SQLiteStore(":memory:"), CountingEmbedder())  # type: ignore[arg-type]
    yield c
    c.close()


def store(cache: SemanticCache, version: str, question: str = "What is 2 + 2?") -> bool:
    """Whether an answer of `version` was written."""
    return cache.store(scope(chat(question), model_version=version), chat(question), "4") is not None


def versions(cache: SemanticCache) -> list[str]:
    return sorted(e.model_version for i in cache.entries.ids_of_tenant(None) if (e := cache.entries.get(i)))


def test_a_version_no_tier_serves_any_more_loses_its_answers_and_a_served_one_keeps_them(
        cache: SemanticCache) -> None:
    served = Served("v1", "other")
    watch = ModelVersions(cache, served)
    assert watch.check() == []
    store(cache, "v1")
    store(cache, "other")
    served.versions = {"v2", "other"}  # the tier moved to v2 (a promotion, new weights)
    assert watch.check() == ["v1"]
    assert versions(cache) == ["other"]
    assert not store(cache, "v1", "What is 3 + 3?")  # a request still running on v1 when it went: not kept
    served.versions = {"v1", "other"}  # rolled back: v1's new answers are kept
    assert watch.check() == ["v2"]
    assert store(cache, "v1")
    cache.reclaim()
    assert versions(cache) == ["other", "v1"]


def test_the_versions_of_before_a_restart_go_once_every_tier_is_known(cache: SemanticCache) -> None:
    store(cache, "old-weights")  # a gateway before the restart ran these
    store(cache, "v1", "What is 3 + 3?")
    served = Served("declared", known=False)  # a local tier whose engine has not reported its fingerprint yet
    watch = ModelVersions(cache, served)
    assert watch.check() == []
    assert versions(cache) == ["old-weights", "v1"]  # nothing is known to be unserved yet
    served.versions, served.known = {"v1"}, True
    assert sorted(watch.check()) == ["declared", "old-weights"]
    assert versions(cache) == ["v1"]


def test_a_fleet_store_is_not_swept_of_the_versions_other_replicas_may_serve(cache: SemanticCache) -> None:
    store(cache, "other-replica")  # another replica of the fleet, on other weights for a while (a rolling deploy)
    store(cache, "v1", "What is 3 + 3?")
    served = Served("v1")
    watch = ModelVersions(cache, served, sweep_store=False)  # gateway/app.py: a Redis store is the fleet's
    assert watch.check() == []
    assert versions(cache) == ["other-replica", "v1"]
    assert store(cache, "other-replica", "What is 4 + 4?")  # its next answers are kept, not deleted again
    served.versions = {"v2"}  # what this replica itself stops serving is still retired
    assert watch.check() == ["v1"]
    assert versions(cache) == ["other-replica", "other-replica"]


class _FailingOnce:
    """A cache whose store fails the first retirement."""

    def __init__(self) -> None:
        self.retired: list[str] = []
        self.failed = False

    def model_versions(self) -> set[str]:
        return set()

    def serve_model_version(self, version: str) -> None:
        pass

    def retire_model_version(self, version: str) -> int:
        if not self.failed:
            self.failed = True
            raise CacheStoreError("database is locked")
        self.retired.append(version)
        return 1


def test_a_retirement_the_store_failed_is_tried_again_next_round() -> None:
    cache, served = _FailingOnce(), Served("v1")
    watch = ModelVersions(cache, served)  # type: ignore[arg-type]
    watch.check()
    served.versions = {"v2"}
    with pytest.raises(CacheStoreError):  # raised for the caller to log (once, gateway/app.py's _every)
        watch.check()
    assert watch.check() == ["v1"] and cache.retired == ["v1"]
    assert watch.check() == []


class _FailingStore(SQLiteStore):
    """A store whose search for a version's entries fails while `failing`."""

    failing = False

    def ids_of_model_version(self, model_version: str, limit: int) -> list[str]:
        if self.failing:
            raise CacheStoreError("database is locked")
        return super().ids_of_model_version(model_version, limit)


def test_a_version_whose_retirement_failed_and_is_served_again_keeps_its_new_answers() -> None:
    entries = _FailingStore(":memory:")
    cache = SemanticCache(entries, CountingEmbedder())  # type: ignore[arg-type]
    try:
        served = Served("v1")
        watch = ModelVersions(cache, served)
        watch.check()
        served.versions, entries.failing = {"v2"}, True  # promoted; the store fails as v1 is retired
        with pytest.raises(CacheStoreError):
            watch.check()
        served.versions, entries.failing = {"v1"}, False  # rolled back before the next round
        assert watch.check() == ["v2"]
        assert store(cache, "v1")  # served: its answers are kept, not dropped as a retired version's
    finally:
        cache.close()
