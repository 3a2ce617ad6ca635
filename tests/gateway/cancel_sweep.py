"""What tests/gateway/test_cancel_sweep.py drives: the real gateway app, in this test's event loop, over ASGI (scope,
receive and send by hand, as bench/gateway_inproc.py's `_drive`), in front of an upstream served by uvicorn in the same
loop, with the embedded stores, quotas, cache and ledger on; and one request of it stopped at its k-th step.

A step is one run of one of the request's tasks, from a suspension point to the next: the handler's task (the ASGI
call) and every task it starts, transitively (Litestar's streaming task, the client watch's listener, what the
pipeline hands off while the request runs). Counting steps, not turns of the loop, makes k name the same place from
one run to the next whatever the worker threads (SQLite, the tokenizer, the embedder) take: a turn spent waiting on a
thread steps none of the request's tasks. The one choice on a request's path that the clock makes, whether the cache
finds a kept answer in this process's map of recent ones or in its store (a thread's wait more: two steps more), is
pinned (`InProcessGateway.read_hits_from_store`). After the k-th step one of three faults is injected:

- `cancel`: the handler's task is cancelled while it waits, as a server cancels an app call (and as `ClientWatch`
  cancels the handler when its client leaves);
- `late`: the same, as the handler's next step begins: what it awaited has ended, and the cancellation takes its
  result's place (the client left in the turn of the loop that the result came in);
- `disconnect`: `receive()` answers `http.disconnect` from then on, as a client that closes its connection makes
  the server answer (and `send` sends nothing more, as uvicorn): the app's own listeners hear it (the client watch,
  Litestar's streaming response).

A slow client (`slow`) holds each body message's send for a turn of the loop, as a server's flow control holds it
for a client that reads slowly, so that a stream can be stopped while its generators wait at a `yield`.

Everything the request started is then waited for with the app's own hooks (the settler's, the reserve stage's and
the idempotency stage's `drain`, the cache's), not with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from gateway.app import create_app
from gateway.routes.health import readiness
from gateway.settings import Settings
from gateway.stores import open_tenant_store
from tests.conftest import stub_tiers_yaml
from tests.stubs import health_routes
from tiers.breaker import BreakerConfig

WORDS = ["one", "two", "three", "four", "five", "six"]  # every answer of the upstream, a word a chunk

PLANS = """
default_plan: swept
plans:
  swept:
    allowed_tiers: [mid]
    default_tier: mid
    limits: {max_concurrent: 1, tpm: 10000000, budget_day_usd: "1000"}
    cache: {shadow_check_rate: 0, hit_price_per_1k: "0.0001"}
"""


def tiers(url: str) -> str:
    return stub_tiers_yaml(mid=url)


# ---- the upstream ---------------------------------------------------------------------------------------------


def upstream_app(calls: list[dict[str, Any]]) -> Litestar:
    """An OpenAI-compatible upstream answering WORDS, usage in every chunk. A message containing `FAIL:500` is
    answered HTTP 500 before any byte; `FAIL:mid` streams two words, then an error event (a 5xx: `internal_error`);
    `CASCADE` is answered nothing (an empty answer, which a cascade retries) when asked of model `stub-mid`."""
    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        body = json.loads(await request.body())
        calls.append(body)
        text = " ".join(m.get("content") or "" for m in body["messages"])
        if "FAIL:500" in text:
            return Response({"error": {"message": "the upstream failed", "type": "server_error"}}, status_code=500)
        return Stream(_events(body, len(text.split()), fail_after=2 if "FAIL:mid" in text else None,
                              empty="CASCADE" in text and body["model"] == "stub-mid"),
                      media_type="text/event-stream")

    return Litestar([*health_routes("stub-mid"), chat])


async def _events(body: dict[str, Any], prompt_tokens: int, fail_after: int | None,
                  empty: bool = False) -> AsyncIterator[bytes]:
    def event(data: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    words = [] if empty else WORDS[: body.get("max_tokens") or len(WORDS)]
    yield event({"id": "u", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    for i, word in enumerate(words):
        await asyncio.sleep(0.001)  # a chunk at a time: the gateway reads each apart, a step or more each
        if i == fail_after:
            yield event({"error": {"message": "the upstream failed mid-answer", "type": "server_error",
                                   "code": "internal_error"}})
            yield b"data: [DONE]\n\n"
            return
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1, "total_tokens": prompt_tokens + i + 1}
        yield event({"id": "u", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": (" " if i else "") + word}, "finish_reason": None}],
                     "usage": usage})
    finish = "stop" if empty or len(words) == len(WORDS) else "length"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
             "total_tokens": prompt_tokens + len(words)}
    yield event({"id": "u", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage})
    yield b"data: [DONE]\n\n"


# ---- counting a request's steps --------------------------------------------------------------------------------


class Steps:
    """The steps of one request's tasks, counted; after the `at`-th, `fault()` is called once (if the request has not
    ended)."""

    def __init__(self, at: int | None, fault: Any, *, late: bool = False) -> None:
        self.at = at
        self.fault = fault
        self.late = late  # the fault waits for the handler's next step and is injected as it begins
        self.due = False
        self.count = 0
        self.root: asyncio.Task[Any] | None = None
        # every task of the request, held weakly: a task ended holds its exception, whose traceback holds the frames
        # and what they held (an answer's generators), which the test must not keep alive
        self.tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self.fired = False

    def stepped(self) -> None:
        self.count += 1
        if self.count == self.at and self.root is not None and not self.root.done():
            if self.late:
                self.due = True
            else:
                self.fired = True
                self.fault()

    def stepping(self, task: asyncio.Task[Any]) -> None:
        """`task` is about to step: a late fault due is injected now if it is the handler's (what it awaited has
        ended, and the cancellation comes in its place: the client left in the same turn of the loop)."""
        if self.due and task is self.root:
            self.due = False
            self.fired = True
            self.fault()


class _Stepped(asyncio.tasks._PyTask):  # type: ignore[name-defined,misc]
    """asyncio's pure-Python task (the C one cannot be told of its steps), counting its steps in `steps`."""

    steps: Steps | None = None

    def _Task__step(self, exc: BaseException | None = None) -> None:
        if self.steps is not None:
            self.steps.stepping(self)
        super()._Task__step(exc)
        if self.steps is not None:
            self.steps.stepped()


def _factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
    """Tasks started by a request's task belong to its request (counted); every other task is asyncio's own."""
    parent = asyncio.current_task(loop)
    steps = getattr(parent, "steps", None)
    if steps is None or steps.root is None or steps.root.done():
        return asyncio.Task(coro, loop=loop, **kwargs)
    task = _Stepped(coro, loop=loop, **kwargs)
    task.steps = steps
    steps.tasks.add(task)
    return task


# ---- one request -----------------------------------------------------------------------------------------------


@dataclass
class Answer:
    request_id: str
    status: int | None = None  # None: no response started
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False  # the last body message came (more_body false)
    steps: int = 0
    fired: bool = False  # the fault was injected before the request ended

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[dict[str, Any]]:
        """A stream's `data:` events, up to `[DONE]`."""
        out = []
        for line in self.body.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
        return out


class InProcessGateway:
    """The gateway's app and an upstream, both in the running event loop; `request` drives one chat request."""

    def __init__(self, tmp_path: Path, models_dir: Path, plans: str = PLANS,
                 tiers_file: Callable[[str], str] = tiers) -> None:
        """`plans`: the plans file (its default plan, `swept`, is the tenant's); `tiers_file`: the tiers file for the
        upstream's URL (every tier's replica is the one upstream; `mid` is the one there by default)."""
        self.tmp_path = tmp_path
        self.models_dir = models_dir
        self.plans = plans
        self.tiers_file = tiers_file
        self.calls: list[dict[str, Any]] = []
        self.loop_errors: list[dict[str, Any]] = []  # what the event loop reported (a task exception never retrieved)
        self.key = ""
        self.last: Steps | None = None  # the last request's steps and tasks

    async def __aenter__(self) -> InProcessGateway:
        loop = asyncio.get_running_loop()
        self._old_handler = loop.get_exception_handler()
        loop.set_exception_handler(lambda _, context: self.loop_errors.append(context))
        self._sock = socket.socket()
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it: no 40 ms
        self._sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._upstream = uvicorn.Server(uvicorn.Config(upstream_app(self.calls), log_level="warning", lifespan="off"))
        self._upstream.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # the test's loop's
        self._upstream_task = asyncio.create_task(self._upstream.serve(sockets=[self._sock]))
        while not self._upstream.started:
            await asyncio.sleep(0.01)
        (self.tmp_path / "tiers.yaml").write_text(self.tiers_file(url))
        (self.tmp_path / "plans.yaml").write_text(self.plans)
        self.settings = Settings(data_dir=self.tmp_path / "data", models_dir=self.models_dir,
                                 tiers_file=self.tmp_path / "tiers.yaml", plans_file=self.tmp_path / "plans.yaml")
        store = open_tenant_store(self.settings)
        store.create_tenant("acme", "swept")
        _, self.key = store.issue_key("acme", name="test")
        store.close()
        self.app = create_app(self.settings)
        self._startup: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        await self._startup.put({"type": "lifespan.startup"})
        self._lifespan = asyncio.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                      self._startup.get, self._replies.put))
        started = await self._replies.get()
        assert started["type"] == "lifespan.startup.complete", started
        self.services = self.app.state.services
        self.services.pipeline.idempotency.wait_s = 0.5  # a key left claimed is a 409 soon, not after 10 s
        self.read_hits_from_store(False)
        for _ in range(500):
            if readiness(self.services.fleet, self.services.ledger)[0]:
                break
            await asyncio.sleep(0.02)
        for spec in self.services.catalogue.tiers.values():
            for replica in self.services.fleet.replicas_of(spec):
                # the upstream fails on purpose, every other request of a sweep: that must not take a tier away
                replica.breaker.config = BreakerConfig(failures_to_open=1 << 30, failure_rate_to_open=2.0)
        loop.set_task_factory(_factory)
        return self

    async def __aexit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(None)
        await self._startup.put({"type": "lifespan.shutdown"})
        await self._replies.get()
        await self._lifespan
        self._upstream.should_exit = True
        await self._upstream_task
        self._sock.close()
        loop.set_exception_handler(self._old_handler)

    def read_hits_from_store(self, store: bool) -> None:
        """Pin where a lookup finds a kept answer: this process's map of recent answers (False) or, every time, the
        store in a worker thread (True). Left to the clock, the map serves while the cache's change feed caught up less
        than `sync_interval_s` (0.5 s) ago, and the first lookup after reads the store (and catches up): a hit's k-th
        step was before its row in one request and after it in the next, as the wall clock went (a loaded run's hit
        sweep saw its stop of k = 4 land before the row, read from the store, and its k = 5 find the request ended,
        read from the map: every stop before the row)."""
        assert self.services.cache.cache is not None
        self.services.cache.cache.feed.interval_s = 0.0 if store else math.inf  # 0: never recent, always due

    async def request(self, body: dict[str, Any], *, headers: dict[str, str] | None = None, at: int | None = None,
                      fault: str = "cancel", slow: bool = False, leave_at_body: int | None = None) -> Answer:
        """One POST /v1/chat/completions; with `at`, `fault` after its `at`-th step: "cancel" (the handler, while it
        waits), "late" (the handler, as its next step begins: what it awaited has ended, its result is lost to the
        cancellation) or "disconnect". `slow`: a client that reads slowly, so that each body message waits to be
        sent (a server's flow control), and the answer's generators wait at their `yield` meanwhile.
        `leave_at_body`: with no step counted, the client disconnects while the server waits to send the body
        message of that number (from 1), as a slow client leaving mid-stream does."""
        data = json.dumps(body).encode()
        raw = [(b"host", b"gateway"), (b"authorization", f"Bearer {self.key}".encode()),
               (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]
        state: dict[str, Any] = {}
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "", "headers": raw,
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080), "state": state}
        gone = asyncio.Event()  # the client has disconnected
        over = asyncio.Event()  # the connection is over: the client gone, or the whole response sent
        read = False
        answer = Answer("")
        bodies: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": data, "more_body": False}
            await over.wait()  # as uvicorn: nothing more comes until the client leaves or the response is sent
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if gone.is_set():  # as uvicorn does once its client has gone: nothing more is sent
                return
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                answer.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                bodies.append(message)
                if len(bodies) == leave_at_body:
                    gone.set()
                    over.set()
                if slow or leave_at_body is not None:
                    await asyncio.sleep(0)
                    if gone.is_set():
                        return
                answer.body += message.get("body", b"")
                answer.complete = not message.get("more_body", False)
                if answer.complete:
                    over.set()

        task: asyncio.Task[None] | None = None

        def inject() -> None:
            if fault in ("cancel", "late"):
                assert task is not None
                task.cancel()
            else:
                gone.set()
                over.set()

        steps = Steps(at, inject, late=fault == "late")
        task = _Stepped(self.app(scope, receive, send))
        task.steps = steps
        steps.root = task
        steps.tasks.add(task)
        self.last = steps
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await task
        over.set()  # the connection is over: a listener still waiting hears the end
        # the handler's task, ended, holds its exception, and that the frames it ran through: not kept alive here
        steps.root = steps.fault = task = None
        answer.request_id, answer.steps, answer.fired = state.get("request_id", ""), steps.count, steps.fired
        return answer

    def assert_nothing_held(self, tenant: str = "acme") -> None:
        """Nothing held for `tenant`: no place at the gate, no tier queue's slot or wait, no reservation open."""
        services = self.services
        assert services.pipeline.gate.in_flight(tenant) == 0
        for name, queue in services.queues.items():
            assert (queue.in_flight, queue.num_waiting) == (0, 0), name
        assert services.quota_backend.expired(float("inf")) == []  # no reservation open

    async def assert_left_settled(self, answer: Answer) -> None:
        """A client left mid-stream: what its request handed off has ended, nothing is held, and its row says it was
        cancelled or answered whole."""
        await self.quiesce()
        self.assert_nothing_held()
        row = self.services.ledger.get(answer.request_id)
        assert row is not None and row.status in ("cancelled", "ok"), row

    async def quiesce(self) -> None:
        """Wait for everything the requests handed off: settlements (their ledger rows durable first), reservations
        and Idempotency-Key claims of requests that left, the cache's writes."""
        pipeline = self.services.pipeline
        for _ in range(3):  # one may hand off to another (a settle's kept answer, a reserve's give-back)
            await pipeline.settler.drain()
            await pipeline.reserve.drain()
            await pipeline.idempotency.drain()
            await self.services.cache.drain()
