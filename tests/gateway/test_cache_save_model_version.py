"""An answer is kept under the model version its lookup scoped only while the tier still runs that version: a replica
that came back with other weights while the request waited may have answered it, and the answer, kept under the old
version, would be served once the tier was rolled back to it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from cache import SemanticCache, SQLiteStore
from gateway.pipeline.cache_lookup import CacheStage
from gateway.pipeline.meter import Outcome
from tests.cache.test_vectors_scope import CountingEmbedder
from wire.chat_request import ChatCompletionRequest

BODY = {"model": "mid", "temperature": 0, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}


class _Fleet:
    def __init__(self, version: str) -> None:
        self.version = version

    def model_version(self, tier: Any) -> str:
        return self.version


def _answer(text: str) -> Outcome:
    return Outcome(status="ok", http_status=200, error_code=None, input_tokens=5, output_tokens=1,
                   finish_reason="stop", text=text, ttft_s=0.1, upstream_s=0.1, busy_s=None, mean_logprob=None)


class _Tenants:
    async def data_version_async(self, tenant: str) -> int:
        return 1


def _context() -> Any:
    cache = SimpleNamespace(enabled=True, semantic=True, similarity_threshold=0.8, ttl_s=None, max_error_rate=None,
                            shadow_check_rate=0.0, meaning_check=False, isolate_users=False)
    return SimpleNamespace(headers={}, tenant="acme", principal=SimpleNamespace(key=SimpleNamespace(roles=())),
                           plan=SimpleNamespace(cache=cache, routing=SimpleNamespace(cascade=False)))


def _served_after(version_at_answer: str) -> bool:
    """Whether an answer looked up under weights v1, answered under `version_at_answer`, is served once the tier runs
    v1 again."""
    cache = SemanticCache(SQLiteStore(":memory:"), CountingEmbedder())  # type: ignore[arg-type]
    fleet = _Fleet("weights-v1")
    stage = CacheStage(cache=cache, store=_Tenants(), fleet=fleet)  # type: ignore[arg-type]
    req, degr = ChatCompletionRequest(**BODY), SimpleNamespace(semantic_threshold_delta=0.0)

    async def ask() -> str:
        lookup = await stage.lookup(_context(), req, object(), degr)  # type: ignore[arg-type]
        if lookup.hit is None:
            fleet.version = version_at_answer  # a replica came back with these weights and answered
            stage.save(lookup, _answer("4"), ())
            await stage.drain()
        return lookup.status

    try:
        assert asyncio.run(ask()) == "miss"
        fleet.version = "weights-v1"  # rolled back
        return asyncio.run(ask()) == "hit"
    finally:
        cache.close()


def test_an_answer_of_other_weights_is_not_kept_under_the_looked_up_version() -> None:
    assert not _served_after("weights-v2")


def test_an_answer_of_the_looked_up_version_is_kept() -> None:
    assert _served_after("weights-v1")
