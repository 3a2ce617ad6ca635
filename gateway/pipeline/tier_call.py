"""Call the tier: pick a replica, open its stream, and report each replica's outcome to its breaker.

The upstream is always asked to stream (with usage in every chunk), whether or not the client streams:
the gateway counts what ran even when the client leaves, and one code path serves both. A replica that
cannot be reached gets one retry on another replica of the tier; any other failure is final.

Replica choice (tiers/replica_choice.py) keeps a conversation on the replica that served its earlier
turns; each call's outcome feeds that replica's circuit breaker and latency average.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.pipeline.text_completion import is_raw
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.errors import NoTierAvailable, TierError, UpstreamRejected, UpstreamUnreachable
from tiers.fleet import Fleet
from tiers.replica import Replica
from wire.chat_request import ChatCompletionRequest

MAX_REPLICAS_TRIED = 2


def cache_salt(tier: TierSpec, tenant: str | None) -> str | None:
    """The tenant's namespace in a local engine's prefix cache (a digest: the engine never reads a tenant's name);
    None for a remote tier, which gets OpenAI's request only, and for our own calls (shadow and cache checks)."""
    if tenant is None or tier.backend != "local":
        return None
    return hashlib.blake2b(tenant.encode(), digest_size=16, person=b"tiergate-salt").hexdigest()


def upstream_body(req: ChatCompletionRequest, tier: TierSpec, *, max_tokens: int, priority: int,
                  logprobs: bool, top_logprobs: int | None = None) -> dict[str, Any]:
    """The body the tier gets: the client's, with our output cap and streaming options, plus the extensions its
    server accepts (the tier's `dialect`: usage in every chunk, the plan's priority); a plain OpenAI-compatible
    server gets OpenAI's fields only, since a strict one refuses what it does not know. `top_logprobs`: the
    alternatives per token a check of ours reads (never set over the client's own choice)."""
    body = req.model_dump(exclude_none=True, exclude={"model", "stream", "stream_options", "priority",
                                                      "max_completion_tokens", "max_tokens", "prompt_format"})
    raw = is_raw(req)
    if raw:  # a text completion: its prompt as it was sent, to the tier's /v1/completions (`TierCaller._chunks`)
        body["prompt"] = body.pop("messages")[0]["content"]
        body.pop("logprobs", None)  # chat's boolean; the legacy field is an integer, set below when wanted
    body["model"] = tier.name if tier.backend == "local" else tier.model
    body["max_tokens"] = max_tokens  # never more than the reservation covers
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if tier.sends_continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if tier.sends_priority:
        body["priority"] = priority
    if logprobs:
        body["logprobs"] = (top_logprobs or 0) if raw else True  # legacy: an integer, the alternatives per token
        if top_logprobs and not raw:
            body["top_logprobs"] = top_logprobs
    return body


class Upstream:
    """One open stream from one replica: its chunks, in order, the first one already read."""

    def __init__(self, replica: Replica, chunks: AsyncIterator[dict[str, Any]], first: dict[str, Any] | None) -> None:
        self.replica = replica
        self._chunks = chunks
        self._first = first

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        if self._first is None:
            return
        yield self._first
        async for chunk in self._chunks:  # (not `anext(chunks, None)` a chunk: its default wraps every await)
            yield chunk

    async def aclose(self) -> None:
        await self._chunks.aclose()  # type: ignore[attr-defined]


class TierCaller:
    def __init__(self, *, fleet: Fleet, client: TierClient) -> None:
        self.fleet = fleet
        self.client = client

    async def open(self, tier: TierSpec, body: dict[str, Any], *, affinity: str | None,
                   tenant: str | None = None) -> Upstream:
        """The tier's stream with its first chunk read, so a failure surfaces before any byte is sent. `tenant`: a
        local engine then keeps the request's prompt in that tenant's own prefix cache namespace (`cache_salt`)."""
        tried: set[int] = set()
        last: TierError | None = None
        for _ in range(MAX_REPLICAS_TRIED):
            try:
                replica, _why = self.fleet.pick(tier.name, exclude=tried, affinity=affinity, version=tier.version_name,
                                                tenant=tenant or "")
            except NoTierAvailable as exc:
                raise (last or exc) from None
            tried.add(replica.index)
            chunks = self._chunks(replica, tier, body, affinity, cache_salt(tier, tenant), tenant or "")
            try:
                return Upstream(replica, chunks, await anext(chunks, None))
            except UpstreamUnreachable as exc:
                replica.mark("down", f"unreachable: {exc}")
                last = exc
        assert last is not None
        raise last

    async def _chunks(self, replica: Replica, tier: TierSpec, body: dict[str, Any], affinity: str | None,
                      salt: str | None = None, tenant: str = "") -> AsyncIterator[dict[str, Any]]:
        """The replica's chunks; how the call went is told to its breaker, latency average and affinity."""
        assert replica.url is not None
        replica.inflight += 1
        finished = False
        verdict: bool | None = None  # True: the replica answered; False: it failed; None: nobody knows
        t0 = time.perf_counter()
        try:
            stream = self.client.stream_completion if "prompt" in body else self.client.stream_chat
            async for chunk in stream(replica.url, body, api_key=self.fleet.api_key(tier), cache_salt=salt):
                finished = finished or any(isinstance(c, dict) and c.get("finish_reason")
                                           for c in chunk.get("choices") or [])
                yield chunk
            verdict = True
        except UpstreamRejected as exc:
            verdict = exc.status < 500  # a client error is a healthy replica's answer
            if not verdict:
                replica.breaker.failure(f"answered {exc.status}")
            raise
        except TierError as exc:
            verdict = False
            replica.breaker.failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            replica.inflight -= 1
            if verdict:
                replica.breaker.success()
            if verdict is None:  # cancelled: no verdict, but a half-open probe must not stay claimed
                replica.breaker.abandon()
            elif verdict and finished:
                replica.observe_latency(time.perf_counter() - t0)
                self.fleet.served(affinity, replica, tenant)
