"""Call the tier: pick a replica, open its stream, and report each replica's outcome to its breaker.

The upstream is always asked to stream (with usage in every chunk), whether or not the client streams:
the gateway counts what ran even when the client leaves, and one code path serves both. A replica that
cannot be reached gets one retry on another replica of the tier; any other failure is final.

Replica choice (tiers/replica_choice.py) keeps a conversation on the replica that served its earlier
turns; each call's outcome feeds that replica's circuit breaker and latency average.

Tenants share a remote tier's server (one upstream account, one prefix cache), so what names a tenant's users or
caches is not forwarded as the tenant wrote it (`forwarded`): `user`, `safety_identifier` and `prompt_cache_key`
become a keyed hash of (tenant, value), stable for one tenant and apart across tenants (no tenant can choose
another's cache key, nor get another's end user blocked upstream), and a vLLM gets the tenant's prefix-cache
namespace as `cache_salt`; under a plan isolating its end users (`isolated_user`), a namespace per end user of the
tenant (a prefix cached for one is not a hit for another, whose time to first token would tell what the first sent),
`<tenant digest>.<end user's keyed digest>`: our engine shares its slots by what comes before the '.'
(engine/sequence.py's salt_tenant), so the end users still take one tenant's share. The hash's key comes from
TIERGATE_HINT_SECRET, which every replica must share (any value, kept from the upstream); unset, the hashes are
still per tenant and stable, but an upstream that guesses a tenant's name and a user id can check the guess. Local
engines get the body as it is, and the tenant's namespace as a header (`cache_salt`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.pipeline.text_completion import is_raw
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.errors import NoTierAvailable, TierError, UpstreamRejected, UpstreamUnreachable
from tiers.fleet import Fleet
from tiers.replica import Replica
from wire.chat_request import ChatCompletionRequest

MAX_REPLICAS_TRIED = 2
HINT_SECRET_ENV = "TIERGATE_HINT_SECRET"
HINTS = ("user", "safety_identifier", "prompt_cache_key")  # a tenant's names for its users and its caches


def tenant_salt(tenant: str, end_user: str | None = None, key: bytes = b"") -> str:
    """The tenant's prefix-cache namespace on an engine (a digest: the engine never reads a tenant's name), or its
    `end_user`'s (`isolated_user`): the tenant's digest, '.', and a digest of the end user keyed by `key` (the
    hints' key: an upstream cannot check a guessed user id), 57 characters within our engine's 64."""
    salt = hashlib.blake2b(tenant.encode(), digest_size=16, person=b"tiergate-salt").hexdigest()
    if end_user is None:
        return salt
    message = f"{len(tenant)}:{tenant}{end_user}".encode()  # the length: no two (tenant, end user) pairs meet
    return f"{salt}.{hashlib.blake2b(message, key=key, digest_size=12, person=b'tiergate-usalt').hexdigest()}"


def cache_salt(tier: TierSpec, tenant: str | None, end_user: str | None = None, key: bytes = b"") -> str | None:
    """The tenant's (or its isolated end user's) namespace in our engine's prefix cache, sent as a header to a tier
    speaking `tiergate`; None for any other tier (a vLLM gets it in the body: `forwarded`) and for a call of no
    tenant's (a shadow or cache check goes as the tenant it copies: off_path.py)."""
    if tenant is None or not (tier.backend == "local" or tier.dialect == "tiergate"):
        return None
    return tenant_salt(tenant, end_user, key)


def hint_key(secret: str | None = None) -> bytes:
    """The key of the hints' hash: from `secret`, or TIERGATE_HINT_SECRET (the same on every replica)."""
    secret = os.environ.get(HINT_SECRET_ENV, "") if secret is None else secret
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"tiergate-hints").digest()


def forwarded(body: dict[str, Any], tier: TierSpec, tenant: str | None, key: bytes,
              end_user: str | None = None) -> dict[str, Any]:
    """The body as a remote tier gets it from `tenant`: its hints hashed with `key` (32 hex digits, within OpenAI's
    64-character `safety_identifier`), a vLLM's `cache_salt` added (the isolated `end_user`'s, `tenant_salt`). Our own
    calls (`tenant` None) carry no hints. A local tier's body is returned as it is."""
    if tier.backend == "local":
        return body
    out = {k: v for k, v in body.items() if k not in HINTS}
    if tenant is not None:
        for field in HINTS:
            if isinstance(value := body.get(field), str):
                message = f"{len(tenant)}:{tenant}{value}".encode()  # the length: no two (tenant, value) pairs meet
                out[field] = hmac.digest(key, message, "sha256")[:16].hex()
        if tier.sends_cache_salt:
            out["cache_salt"] = tenant_salt(tenant, end_user, key)
    return out


def upstream_body(req: ChatCompletionRequest, tier: TierSpec, *, max_tokens: int, priority: int,
                  logprobs: bool, top_logprobs: int | None = None) -> dict[str, Any]:
    """The body the tier gets: the client's, with our output cap and streaming options, plus the extensions its
    server accepts (the tier's `dialect`: usage in every chunk, the plan's priority); a plain OpenAI-compatible
    server gets OpenAI's fields only, since a strict one refuses what it does not know. vLLM's `top_k` reaches only
    tiers that sample by it (routing keeps a request that sets it off the others: needs.py); turned off (-1, 0, every
    server's default) it is left out. A text completion's `response_format` likewise reaches only tiers whose
    /v1/completions takes it, and is left out where it is `text`. `presence_penalty` and `frequency_penalty` reach
    every tier (OpenAI's, vLLM's and llama.cpp's servers take both), left out where 0. `top_logprobs`: the
    alternatives per token a check of ours reads (never set over the client's own choice)."""
    body = req.model_dump(exclude_none=True, exclude={"model", "stream", "stream_options", "priority",
                                                      "max_completion_tokens", "max_tokens", "prompt_format"})
    if body.get("top_k", 1) <= 0:
        del body["top_k"]
    for penalty in ("presence_penalty", "frequency_penalty"):  # every server takes them; 0 is every server's default
        if body.get(penalty) == 0:
            del body[penalty]
    raw = is_raw(req)
    if raw:  # a text completion: its prompt as it was sent, to the tier's /v1/completions (`TierCaller._chunks`)
        body["prompt"] = body.pop("messages")[0]["content"]
        body.pop("logprobs", None)  # chat's boolean; the legacy field is an integer, set below when wanted
        if body.get("response_format", {}).get("type") == "text":  # no constraint, and not OpenAI's legacy field
            del body["response_format"]
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
    def __init__(self, *, fleet: Fleet, client: TierClient, hint_secret: str | None = None) -> None:
        self.fleet = fleet
        self.client = client
        self.hint_key = hint_key(hint_secret)  # what hashes the tenants' hints for remote tiers (`forwarded`)

    async def open(self, tier: TierSpec, body: dict[str, Any], *, affinity: str | None,
                   tenant: str | None = None, end_user: str | None = None,
                   on_sent: Callable[[], None] | None = None) -> Upstream:
        """The tier's stream with its first chunk read, so a failure surfaces before any byte is sent. `tenant`: a tier
        then keeps the request's prompt in that tenant's own prefix cache namespace, and a remote tier gets the
        tenant's hints hashed (`forwarded`); `end_user`: the end user the tenant's plan isolates
        (`isolated_user`), whose prompts get a namespace of their own within the tenant's. `on_sent()`: called
        as the request is written to a replica's connection (TierClient.stream_chat), not while the gateway
        still connects."""
        body = forwarded(body, tier, tenant, self.hint_key, end_user)
        salt = cache_salt(tier, tenant, end_user, self.hint_key)
        tried: set[int] = set()
        last: TierError | None = None
        for _ in range(MAX_REPLICAS_TRIED):
            try:
                replica, _why = self.fleet.pick(tier.name, exclude=tried, affinity=affinity, version=tier.version_name,
                                                tenant=tenant or "")
            except NoTierAvailable as exc:
                raise (last or exc) from None
            tried.add(replica.index)
            chunks = self._chunks(replica, tier, body, affinity, salt, tenant or "", on_sent)
            try:
                return Upstream(replica, chunks, await anext(chunks, None))
            except UpstreamUnreachable as exc:
                replica.mark("down", f"unreachable: {exc}")
                last = exc
        assert last is not None
        raise last

    async def _chunks(self, replica: Replica, tier: TierSpec, body: dict[str, Any], affinity: str | None,
                      salt: str | None = None, tenant: str = "",
                      on_sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The replica's chunks; how the call went is told to its breaker, latency average and affinity."""
        assert replica.url is not None
        if replica.inflight == 0:
            replica.busy_since = time.monotonic()  # what a busy replica's health check forgives from (tiers/fleet.py)
        replica.inflight += 1
        finished = False
        verdict: bool | None = None  # True: the replica answered; False: it failed; None: nobody knows
        t0 = time.perf_counter()
        try:
            stream = self.client.stream_completion if "prompt" in body else self.client.stream_chat
            async for chunk in stream(replica.url, body, api_key=self.fleet.api_key(tier), cache_salt=salt,
                                      on_sent=on_sent):
                finished = finished or any(isinstance(c, dict) and c.get("finish_reason")
                                           for c in chunk.get("choices") or [])
                replica.last_heard = time.monotonic()  # busy, not hung: its health check may wait (tiers/fleet.py)
                yield chunk
            verdict = True
        except UpstreamRejected as exc:
            # an answer about the tenant's request is a healthy replica's; anything the tenant reads as our 502
            # (a 5xx, the tier's key, path or model name refused) is the replica's failure (`replica_failed`)
            verdict = not exc.replica_failed
            if not verdict:
                replica.breaker.failure(f"answered {exc.status}", tenant)
            raise
        except TierError as exc:
            verdict = False
            replica.breaker.failure(f"{type(exc).__name__}: {exc}", tenant)
            raise
        finally:
            replica.inflight -= 1
            if verdict:
                replica.breaker.success(tenant)
            if verdict is None:  # cancelled: no verdict, but a half-open probe must not stay claimed
                replica.breaker.abandon()
            elif verdict and finished:
                replica.observe_latency(time.perf_counter() - t0)
                self.fleet.served(affinity, replica, tenant)
