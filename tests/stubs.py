"""Test doubles that speak real HTTP: an OpenAI-compatible stub upstream, run by uvicorn in a thread.

The stub answers with a fixed sentence, one word per chunk, and reports usage and busy time the way our
engine does. Message content can steer it: `STUB:400` answers 400, `STUB:slow` streams slowly (for
cancellation), `STUB:die` drops the connection mid-stream, `STUB:big` answers up to 50,000 pieces of 1,000
characters (more than the sockets between a client and the gateway hold; a piece a token, within what the gateway
relays a token, gateway/pipeline/meter.py MAX_TOKEN_CHARS), `STUB:schema-fail` streams two words and
then our engine's error event for a response_format whose grammar could not go on (`response_format_failed`), and
`STUB:refused-late` opens its stream and then sends our engine's refusal of a request as it starts (a 400's body,
`invalid_value`, marked `status: 400`: engine/answer_frames.py, the tenant's format refused in between), and
`STUB:bad-key-event` an upstream's own fault as an error event of type `invalid_request_error` (`invalid_api_key`).

Also what the tests that start a gateway in front of such upstreams share: the routes every upstream answers
(`health_routes`), a tiers file of OpenAI-compatible tiers (`openai_tiers`), a ladder of three such tiers and plans
over it (`LADDER_PRICES`, `LADDER_PLANS`) and the settings of a gateway that reads them (`write_settings`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import Stream

from gateway.settings import Settings

REPLY = "Hello from the stub upstream ."
TEXT_REPLY = "and so the stub went on ."  # what it continues a text completion's prompt with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# how long a server's startup may take: a gateway's loads the embedder (a few seconds alone, past 20 s on a 2-core
# machine running other tests, which made "server did not start" the suite's one flaky error); a startup that fails
# ends sooner, its thread dead
START_TIMEOUT_S = 90.0


class StubState:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.finished: list[str] = []  # "done" or "disconnected", in order


def health_routes(model: str = "stub") -> list[HTTPRouteHandler]:
    """GET /health and GET /v1/models (listing `model`), new for each app: what the gateway's health check of a
    remote tier reads."""
    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    return [health, models]


def stub_app(state: StubState, reply: str = REPLY) -> Litestar:
    """An OpenAI-compatible upstream answering `reply` (cut at max_tokens words) to every chat."""
    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        body = json.loads(await request.body())
        state.requests.append(body)
        text = " ".join(m.get("content") or "" for m in body["messages"])
        if "STUB:400" in text:
            return Response({"error": {"message": "stub says the prompt is too long", "type": "invalid_request_error",
                                       "param": "messages", "code": "context_length_exceeded"}}, status_code=400)
        prompt_tokens = len(text.split())
        cap = body.get("max_tokens") or body.get("max_completion_tokens") or 99
        words = ["y" * 1_000] * min(cap, 50_000) if "STUB:big" in text else reply.split()[:cap]
        # a dying stream writes at an engine's pace, so the gateway has read what came before the death
        delay = 0.2 if "STUB:slow" in text else 0.02 if "STUB:die" in text else 0.0
        return Stream(_sse(state, body, words, prompt_tokens, delay, die="STUB:die" in text,
                           whole=50_000 if "STUB:big" in text else len(reply.split()),
                           schema_fail="STUB:schema-fail" in text, refused_late="STUB:refused-late" in text,
                           bad_key_event="STUB:bad-key-event" in text),
                      media_type="text/event-stream")

    @post("/v1/completions", status_code=200)
    async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
        """Legacy text completions: the prompt as it came (recorded), continued by TEXT_REPLY."""
        body = json.loads(await request.body())
        state.requests.append(body)
        words = TEXT_REPLY.split()[: body.get("max_tokens") or 16]
        return Stream(_sse(state, body, words, len(str(body["prompt"]).split()), 0.0, die=False, legacy=True),
                      media_type="text/event-stream")

    return Litestar([*health_routes(), chat, completions])


async def _sse(state: StubState, body: dict[str, Any], words: list[str], prompt_tokens: int, delay: float,
               die: bool, legacy: bool = False, whole: int | None = None,
               schema_fail: bool = False, refused_late: bool = False,
               bad_key_event: bool = False) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        data = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        if legacy:  # a text completion's chunk: the next piece as `text`
            data |= {"object": "text_completion", "choices": [
                {"index": 0, "text": delta.get("content", ""), "finish_reason": finish, "logprobs": None}]}
        return f"data: {json.dumps(data)}\n\n".encode()

    try:
        if not legacy:
            yield chunk({"role": "assistant", "content": ""})
        if refused_late or bad_key_event:
            error = {"message": "response_format: refused to this tenant", "type": "invalid_request_error",
                     "param": "response_format", "code": "invalid_value", "status": 400} if refused_late else {
                "message": "Incorrect API key provided", "type": "invalid_request_error", "param": None,
                "code": "invalid_api_key"}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            state.finished.append("done")
            return
        for i, word in enumerate(words):
            await asyncio.sleep(delay)
            if die and i == 2:
                raise RuntimeError("stub dies mid-stream")
            if schema_fail and i == 2:
                error = {"message": "response_format: the answer could not go on within the schema (GrammarError)",
                         "type": "invalid_request_error", "param": "response_format", "code": "response_format_failed"}
                yield f"data: {json.dumps({'error': error})}\n\n".encode()
                yield b"data: [DONE]\n\n"
                state.finished.append("done")
                return
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1, "total_tokens": prompt_tokens + i + 1}
            yield chunk({"content": (" " if i else "") + word}, usage=usage, x_tiergate={"busy_s": 0.001 * (i + 1)})
        n = len(words)
        if whole is None:
            whole = len((TEXT_REPLY if legacy else REPLY).split())
        finish = "length" if n < whole else "stop"
        yield chunk({}, finish, x_tiergate={"busy_s": 0.001 * n})
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        last = {"id": "stub", "choices": [], "usage": usage, "x_tiergate": {"busy_s": 0.001 * n}}
        yield f"data: {json.dumps(last)}\n\n".encode()
        yield b"data: [DONE]\n\n"
        state.finished.append("done")
    except (asyncio.CancelledError, GeneratorExit):
        state.finished.append("disconnected")
        raise


# what every tier of `openai_tiers` has unless it says otherwise
TIER_DEFAULTS: dict[str, Any] = {"backend": "openai", "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                                 "hardware_cost_per_hour": "1", "context_limit": 4096}


# the prices of `small`, `mid` and `full`, cheapest first (`mid` at TIER_DEFAULTS'), which `auto` and a cascade climb
LADDER_PRICES: dict[str, dict[str, Any]] = {
    "small": {"price_per_1k_input": "0.0001", "price_per_1k_output": "0.0002"},
    "mid": {},
    "full": {"price_per_1k_input": "0.003", "price_per_1k_output": "0.006"}}
# plans over that ladder: `standard` (mid by default), `plain` (mid alone), `cascading` (small first, and a weak
# answer climbs); no cache where a test counts what reaches the tiers
LADDER_PLANS = """
default_plan: standard
plans:
  standard:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    cache: {enabled: false}
  plain:
    allowed_tiers: [mid]
    default_tier: mid
  cascading:
    allowed_tiers: [small, mid, full]
    default_tier: small
    cache: {enabled: false}
    routing: {quality_floor: 0.8, policy: cascade}
"""


def openai_tiers(tiers: dict[str, dict[str, Any]], **common: Any) -> str:
    """A tiers file: each tier named in `tiers` with its own fields over `common` over TIER_DEFAULTS, its model
    `stub-NAME` unless one is given; `url` stands for `urls: [url]`. Values are written as JSON (YAML reads it
    alike), so a price given as a string stays the decimal it spells."""
    out = "tiers:\n"
    for name, own in tiers.items():
        fields = TIER_DEFAULTS | {"model": f"stub-{name}"} | common | own
        if "url" in fields:
            fields["urls"] = [fields.pop("url")]
        out += f"  {name}:\n" + "".join(f"    {key}: {json.dumps(value)}\n" for key, value in fields.items())
    return out


def write_settings(directory: Path, models_dir: Path, tiers: str, plans: str, **overrides: Any) -> Settings:
    """A gateway's settings with `tiers` and `plans` written as tiers.yaml and plans.yaml in `directory`, its data
    in directory/data, and `overrides`."""
    (directory / "tiers.yaml").write_text(tiers)
    (directory / "plans.yaml").write_text(plans)
    return Settings(data_dir=directory / "data", models_dir=models_dir, tiers_file=directory / "tiers.yaml",
                    plans_file=directory / "plans.yaml", **overrides)


class ServerThread:
    """Runs an ASGI app with uvicorn on a free loopback port until `stop`."""

    def __init__(self, app: Any, http: Any = "auto", send_buffer: int | None = None) -> None:
        # the socket is bound here and handed to uvicorn: a port found free, closed and bound again later could be
        # taken meanwhile by another xdist worker's server
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer is not None:  # the send buffer of every connection it accepts, fixed (Linux grows one else)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", http=http))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + START_TIMEOUT_S
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ServerThread:  # `with ServerThread(app).start() as server:` stops it at the block's end
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a stub upstream in its own process: python -m tests.stubs PORT
    import sys

    uvicorn.run(stub_app(StubState()), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
