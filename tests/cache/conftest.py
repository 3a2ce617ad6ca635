"""Cache test fixtures: one real MiniLM embedder per session, and a fresh cache per test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cache import CacheScope, Embedder, SemanticCache, SQLiteStore


class FakeClock:
    """A clock the test moves by hand, for TTL."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    e = Embedder()
    e.encode_one("warm up")
    return e


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cache(embedder: Embedder, clock: FakeClock) -> Iterator[SemanticCache]:
    c = SemanticCache(SQLiteStore(":memory:", max_entries=1000), embedder, clock=clock)
    yield c
    c.close()


def chat(question: str, *, system: str = "You are helpful.", history: list[dict[str, Any]] | None = None,
         **params: Any) -> dict[str, Any]:
    """An OpenAI chat request body, deterministic unless `params` say otherwise."""
    body: dict[str, Any] = {"model": "auto", "temperature": 0, **params}
    body["messages"] = [{"role": "system", "content": system}, *(history or []), {"role": "user", "content": question}]
    return body


def scope(body: dict[str, Any] | None = None, **overrides: Any) -> CacheScope:
    """The scope of `body` for tenant acme, role user, data version 1, model m1, unless overridden."""
    args: dict[str, Any] = {"tenant": "acme", "roles": ["user"], "data_version": 1, "model_version": "m1"}
    args.update(overrides)
    return CacheScope.for_request(body or chat("x"), **args)
