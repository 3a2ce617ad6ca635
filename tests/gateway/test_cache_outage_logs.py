"""The cache's writes through a store's outage: every request's write fails the same way, logged once, then one
line when a write works again (not a line a request)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from cache.store import CacheStoreError
from gateway.pipeline.cache_lookup import CacheStage


class _Cache:
    def __init__(self) -> None:
        self.down = True

    async def apersist(self, entry: Any) -> None:
        if self.down:
            raise CacheStoreError("database is locked")


def test_a_cache_store_outage_is_logged_once_then_its_recovery(caplog: pytest.LogCaptureFixture) -> None:
    cache = _Cache()
    stage = CacheStage(cache=cache, store=None, fleet=None)  # type: ignore[arg-type]

    async def requests() -> None:
        for _ in range(20):
            await stage._persist(object())  # type: ignore[arg-type]
        cache.down = False
        await stage._persist(object())  # type: ignore[arg-type]

    with caplog.at_level(logging.INFO, logger="tiergate"):
        asyncio.run(requests())
    assert [r.getMessage() for r in caplog.records] == [
        "cache store failed (logged once until it works again): CacheStoreError: database is locked",
        "cache store recovered after 20 failed stores"]
