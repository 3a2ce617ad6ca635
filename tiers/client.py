"""One HTTP client for every tier backend: local engines and remote OpenAI-compatible servers alike.

What crosses this boundary: an OpenAI chat-completions body goes in; parsed stream chunks (dicts) come
out, in order, ending after the upstream's `[DONE]`. httpx errors become `tiers.errors` exceptions here
and nowhere else, and so does an error event inside a stream (`data: {"error": {...}}`, what an upstream
sends when it fails after the headers): UpstreamRejected with that body, never content. Closing the
iterator early closes the upstream connection, which tells the engine to abort the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tiers.errors import UpstreamProtocolError, UpstreamRejected, UpstreamTimedOut, UpstreamUnreachable
from wire.responses import sse_data


class TierClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0,
                 max_connections: int = 1024) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get_json(self, url: str, *, timeout_s: float = 2.0, api_key: str | None = None) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            resp = await self._client.get(url, timeout=timeout_s, headers=headers)
        except httpx.TimeoutException as exc:
            raise UpstreamTimedOut(f"{url}: no answer in {timeout_s}s") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"{url}: {exc!r}") from exc
        if resp.status_code != 200:
            raise UpstreamRejected(resp.status_code, _json_or_text(resp.content))
        return resp.json()

    async def stream_chat(self, base_url: str, body: dict[str, Any], *,
                          api_key: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming chat completion; yield each `data:` chunk as a dict."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        url = base_url.rstrip("/") + "/v1/chat/completions"
        try:
            async with self._client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raise UpstreamRejected(resp.status_code, _json_or_text(await resp.aread()))
                async for line in resp.aiter_lines():
                    if (data := sse_data(line)) is None:
                        continue
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError as exc:
                        raise UpstreamProtocolError(f"{url}: a stream chunk is not JSON: {data[:200]!r}") from exc
                    if isinstance(chunk, dict) and chunk.get("error") is not None:
                        # the upstream failed after the headers were sent: an error event, not content
                        raise UpstreamRejected(_stream_error_status(chunk), chunk)
                    yield chunk
                raise UpstreamProtocolError(f"{url}: the stream ended without [DONE]")
        except httpx.TimeoutException as exc:
            raise UpstreamTimedOut(f"{url}: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"{url}: {exc!r}") from exc


def _stream_error_status(chunk: dict[str, Any]) -> int:
    """The HTTP status an error event stands for: 503 for a stopped engine, 500 for any other failure."""
    err = chunk.get("error")
    return 503 if isinstance(err, dict) and err.get("code") == "engine_dead" else 500


def _json_or_text(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
        if isinstance(body, dict):
            return body
    except ValueError:
        pass
    return {"error": {"message": content.decode(errors="replace")[:500], "type": "api_error"}}
