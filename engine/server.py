"""The engine's own OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions (legacy text
completions: the prompt as it is, no chat template), /v1/models, /health, /metrics.

It speaks the same API as vLLM (its `priority` field included), so the gateway's one tier client serves
local engines and remote ones alike. Each response also carries `x_tiergate.busy_s`, the engine compute
time attributed to the request, which the gateway turns into compute cost.

Failures keep OpenAI's error shape. Bad input is a 400 naming the field (the wire model validates, the
engine checks again; a refusal that comes only as `generate` starts the request, its response format refused to
the tenant since the server's check by another of its requests failing within the schema, is the same 400, or a
stream's last event before `[DONE]`, its headers sent: engine/answer_frames.py). The OpenAI routes take no query
parameter, as the gateway's take none: one is a 400 naming it (`unsupported_parameter`),
before the body is read (Litestar dropped it: `?stream=true` was answered whole, `?top_k=1`
sampled as if unsent). A body sent with a Content-Encoding other than identity is a 415
`unsupported_content_encoding`, as at the gateway, before it is read (it was read as it came, and a gzipped one
refused as broken JSON). The engine serves one model, under the name it was started with (`--served-name`: the tier's
name when the gateway's supervisor starts it, which is the `model` the gateway sends a local tier, every version of
it alike); a request naming any other is a 404 `model_not_found` (param `model`), as OpenAI's and vLLM's, before
anything is tokenized or generated. A request the engine fails is a 500 `engine_error`, or, once a stream has begun, a
last `data: {"error": ...}` event before `[DONE]`; one that fails by its own content (its response_format's
grammar could not go on) is the same with 400 `response_format_failed`, which no breaker counts against the
replica (wire.errors.REQUEST_FAULT_CODES); a stopped engine loop answers 503 `engine_dead`, and so
does /health, within a second and without waiting on a step. /health is a 503 too (`"status": "unhealthy"`) while
the loop is alive but wedged: one step running past its bound, or a grammar compile past its own
(LLMEngine.health_problem), so the supervisor restarts an engine that would hold every request while reporting ok.
/health also reports `instance`, the nonce
the supervisor gave this process (TIERGATE_ENGINE_INSTANCE), so a probe can tell it from a stranger that
took the port.

`response_format` (json_object, json_schema) is enforced by the engine's grammar-constrained decoding
(engine/grammar.py); a schema it cannot compile is a 400 naming `response_format`, before any byte is streamed. A new
schema is compiled on the engine's compile queue (engine/compile_queue.py: threads of its own, tenants in turn, the
tenant being the gateway's cache salt); when that queue is full for the tenant or for everyone, the answer is a 429
`response_format_compiles_busy` with Retry-After, at once. An engine with as many requests in flight as it takes
(`max_num_seqs` running and `max_waiting` more: LLMEngine.check_capacity) answers a new one 429 `engine_overloaded`
with Retry-After, before it is rendered (the gateway sends no more than its dispatch slots, but this port takes any
caller with the key).
Tools are rendered into the prompt (wire/tool_calls.py) and the answer is shaped into `tool_calls`
(engine/tool_calls.py: a "required" or named tool_choice is enforced by the same grammar path).

A body larger than PARSE_ON_LOOP_BYTES is validated in a worker thread too, so a hostile one that is slow to validate
and refuse holds no other request and no /health probe behind it. The prompt is rendered and tokenized in a worker
thread (with the request's checks; never a grammar compile):
transformers' fast tokenizer call runs
`tokenizers`' `encode_batch`, which releases the GIL (measured: 1.5 MB of text, 1.1 s to tokenize, the event
loop kept running with at most 34 ms between its turns, against 1.16 s with `Tokenizer.encode`). A max_tokens that
leaves no room for a one-token prompt is refused before the prompt is rendered (engine/request_checks.py). The checks
around rendering and tokenizing the prompt (text longer than the context could hold, text that is not Unicode text, a
conversation the chat template refuses, a message `name` it would not write) are engine/request_checks.py's
`PromptChecks`: each a 400 naming the field.

Whatever else fails while an answer is framed (engine/answer_frames.py; a bug, not the request) is a 500 in
OpenAI's shape, or the stream's last event before `[DONE]`, never a connection cut mid-stream; either way the
request's generation is aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import uuid
from typing import Any
from urllib.parse import parse_qsl

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from assets.parent_watch import ENGINE_INSTANCE_ENV
from engine.answer_frames import FAILED, busy, chat_frames, collect, sse_events, text_frames
from engine.engine_auth import key_check
from engine.llm_engine import EngineBusyError, EngineDeadError, EngineInputError, LLMEngine
from engine.request_checks import PromptChecks, check_output_room
from engine.sampling_params import SamplingParams
from engine.sequence import salt_tenant
from engine.tool_calls import ToolAnswer, answer_format, ends_at_first_call, one_call, tools_param
from wire.chat_request import ChatCompletionRequest
from wire.client_watch import CLIENT_CLOSED, ClientLeft, ClientWatch
from wire.completion_request import DEFAULT_MAX_TOKENS as DEFAULT_TEXT_MAX_TOKENS
from wire.completion_request import CompletionRequest
from wire.errors import CACHE_SALT_HEADER, MAX_BODY_BYTES, PAYLOAD_TOO_LARGE, error_body
from wire.response_format import ResponseFormat
from wire.validation import BodyError, parse_body

DEFAULT_MAX_TOKENS = 1024  # without max_tokens: up to this, or what the context has left
# a body up to this size is validated on the event loop (microseconds); a larger one in a worker thread: a 4 MB body of
# a schema with 290K properties took 1.3 s to validate and refuse (wire/response_format.py walks it), the loop and
# /health held meanwhile (a longest pause of 0.5 s in the thread: pydantic-core's own part keeps the GIL)
PARSE_ON_LOOP_BYTES = 64 << 10


_SALT = re.compile(r"[A-Za-z0-9._:-]{1,64}")
log = logging.getLogger("tiergate.engine")

def sampling_params_for(req: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int,
                        max_model_len: int, output_format: ResponseFormat | None) -> SamplingParams:
    """A chat request's (`top_logprobs` when `logprobs`) or a legacy text completion's (`logprobs`: how many);
    `output_format`: what constrains its answer (`answer_format` of a chat request, else its response_format)."""
    chat = isinstance(req, ChatCompletionRequest)
    default = DEFAULT_MAX_TOKENS if chat else DEFAULT_TEXT_MAX_TOKENS
    default_cap = max(1, min(default, max_model_len - num_prompt_tokens))
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        max_tokens=(req.output_cap if chat else req.max_tokens) or default_cap,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        stop=req.stop_list,
        logprobs=((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs,
        response_format=output_format,
    )


class EngineMetrics:
    """A prometheus collector that reads the engine's counters at scrape time."""

    def __init__(self, engine: LLMEngine, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Any:
        s = self.engine.stats()
        for name, doc, value in (
            ("tiergate_engine_running_seqs", "Sequences being generated.", s.num_running),
            ("tiergate_engine_waiting_seqs", "Sequences waiting for a slot.", s.num_waiting),
            ("tiergate_engine_kv_blocks_used", "KV cache blocks held by sequences.", s.num_kv_blocks_used),
            ("tiergate_engine_kv_blocks_free", "KV cache blocks free (some keep a reusable prefix).",
             s.num_kv_blocks_free),
            ("tiergate_engine_kv_blocks_total", "KV cache blocks allocated.", s.num_kv_blocks_total),
            ("tiergate_engine_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, as a fraction.",
             s.prefix_cache_hit_rate),
            ("tiergate_engine_generation_tokens_per_second", "Tokens generated per second, last 10 s.",
             s.generation_tokens_per_s),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric([self.model], value)
            yield g
        for name, doc, value in (
            ("tiergate_engine_prompt_tokens", "Prompt tokens processed.", s.num_prompt_tokens_total),
            ("tiergate_engine_generation_tokens", "Tokens generated.", s.num_generation_tokens_total),
            ("tiergate_engine_busy_seconds", "Seconds the engine spent computing.", s.busy_s_total),
            ("tiergate_engine_requests_finished", "Requests finished.", s.num_requests_finished),
            ("tiergate_engine_requests_failed", "Requests ended by an engine error.", s.num_requests_failed),
            ("tiergate_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.num_prefix_query_tokens_total),
            ("tiergate_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.num_prefix_hit_tokens_total),
            ("tiergate_engine_preemptions", "Sequences preempted: for lack of KV blocks, for a higher priority "
             "waiting, or for a tenant short of its share of the batch.", s.num_preemptions_total),
            ("tiergate_engine_speculative_steps", "Steps in which a draft model proposed tokens.",
             s.num_speculative_steps_total),
            ("tiergate_engine_draft_tokens", "Tokens a draft model proposed.", s.num_draft_tokens_total),
            ("tiergate_engine_draft_tokens_accepted", "Tokens a draft model proposed that the model kept.",
             s.num_accepted_draft_tokens_total),
        ):
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric([self.model], value)
            yield c


def create_engine_app(engine: LLMEngine, *, model_name: str, model_version: str,
                      max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None) -> Litestar:
    """`max_body_bytes`: a larger request body is a 413 before it is read whole (the gateway's limit by default, not
    Litestar's 10 MB: a body the gateway would refuse is not parsed here either). `api_key`: every route but /health
    needs it as a Bearer token (engine/engine_auth.py; None: open, for an engine only this host reaches)."""
    tokenizer = engine.tokenizer
    keyed = key_check(api_key)
    registry = CollectorRegistry()
    registry.register(EngineMetrics(engine, model_name))
    instance = os.environ.get(ENGINE_INSTANCE_ENV)
    prompts = PromptChecks(tokenizer, engine.max_model_len)  # renders and tokenizes, refusing what cannot fit

    async def serve(request: Request[Any, Any, Any], kind: type[ChatCompletionRequest] | type[CompletionRequest],
                    ) -> Response[Any]:
        """Validate, tokenize, generate; the answer framed as the endpoint's API frames it."""
        if (reason := engine.dead_reason) is not None:
            return _dead(reason)
        if (refused := _query_refusal(request) or _encoding_refusal(request)) is not None:
            return refused
        body = await request.body()
        try:  # a large body is validated in a worker thread: the event loop (/health among it) keeps its turns
            req = (parse_body(body, kind) if len(body) <= PARSE_ON_LOOP_BYTES
                   else await asyncio.to_thread(parse_body, body, kind))
        except BodyError as exc:
            return Response(error_body(exc.message, param=exc.param, code=exc.code), status_code=400)
        if req.model != model_name:
            return _unknown_model(req.model, model_name)
        salts = request.headers.getall(CACHE_SALT_HEADER, [])
        if len(salts) > 1:  # the first was used and the others were never checked: no one of them is the request's
            return Response(error_body(f"{CACHE_SALT_HEADER}: sent {len(salts)} times; send it once",
                                       param=CACHE_SALT_HEADER), status_code=400)
        salt = salts[0] if salts else None
        if salt is not None and not _SALT.fullmatch(salt):
            return Response(error_body(f"{CACHE_SALT_HEADER}: 1-64 of A-Za-z0-9._:-", param=CACHE_SALT_HEADER),
                            status_code=400)
        chat = isinstance(req, ChatCompletionRequest)

        def refusal(exc: EngineInputError) -> dict[str, Any]:
            """The 400's body for `exc`, however late it comes (`prepare`, or `generate` as the request starts:
            its response format refused to the tenant in between), with the param the tenant wrote."""
            exc = tools_param(exc, req) if chat else exc  # type: ignore[arg-type]
            param = exc.param if chat or exc.param != "messages" else "prompt"
            return error_body(str(exc), param=param, code=exc.code)

        def prepare() -> tuple[list[int], SamplingParams]:
            """Tokenize and validate; none is compiled. What needs no prompt is refused before it is rendered and
            tokenized (up to a second of a tokenizer thread for a long one): a max_tokens no prompt leaves room for
            (engine/request_checks.py `check_output_room`), a format the answer's free tool calls rule out, and one
            refused to the tenant before."""
            if asked := (req.output_cap if chat else req.max_tokens):  # type: ignore[union-attr]
                check_output_room(asked, max_model_len=engine.max_model_len, block_manager=engine.block_manager)
            fmt = answer_format(req) if chat else req.response_format  # type: ignore[arg-type]
            if fmt is not None and fmt.constrains:
                engine.grammars.known(fmt, salt_tenant(salt))
            ids = prompts.chat_ids(req) if chat else prompts.text_ids(req)  # type: ignore[arg-type]
            params = sampling_params_for(req, len(ids), engine.max_model_len, fmt)
            engine.validate(ids, params, salt_tenant(salt))
            return ids, params

        try:
            engine.check_capacity()  # a full engine refuses before rendering and tokenizing (generate checks again)
            ids, params = await asyncio.to_thread(prepare)
            if params.output_format is not None:  # compiled on the compile queue, in the tenant's turn
                params = dataclasses.replace(params, grammar=await engine.compiled_grammar(params, salt_tenant(salt)))
        except EngineBusyError as exc:
            return Response(busy(exc), status_code=429, headers={"retry-after": str(exc.retry_after_s)})
        except EngineDeadError as exc:
            return _dead(str(exc))
        except EngineInputError as exc:
            return Response(refusal(exc), status_code=400)
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        frames = (chat_frames(tokenizer, ToolAnswer.for_request(req)) if chat  # type: ignore[arg-type]
                  else text_frames(tokenizer, len(req.text)))  # type: ignore[union-attr]
        outputs = engine.generate(ids, params, request_id=rid, priority=req.priority, cache_salt=salt)
        if chat and ends_at_first_call(req):  # type: ignore[arg-type]
            outputs = one_call(outputs, req)  # type: ignore[arg-type]
        if req.stream:
            return Stream(sse_events(outputs, rid, model_name, req.include_usage, req.continuous_usage, frames,
                                     refusal),
                          media_type="text/event-stream", headers={"cache-control": "no-cache"})
        watch = ClientWatch(request)  # a client that leaves before its whole answer stops its generation
        try:
            return await watch.run(collect(outputs, rid, model_name, frames, refusal))
        except ClientLeft:
            await outputs.aclose()  # leaving the iterator aborts the request: its slot and KV blocks are freed
            return Response(None, status_code=CLIENT_CLOSED)
        except EngineDeadError as exc:
            return _dead(str(exc))
        except Exception:
            log.exception("answering %s failed", rid)
            await outputs.aclose()
            return Response(FAILED, status_code=500)
        finally:
            watch.close()

    @get("/health")
    async def health(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        # never waits on the engine: health_problem and stats() read without the engine's lock
        if (reason := engine.health_problem) is not None:  # dead, or alive but wedged: not ok either way
            status = "dead" if engine.dead_reason is not None else "unhealthy"
            return Response({"status": status, "reason": reason, "model": model_name,
                             "model_version": model_version, "instance": instance}, status_code=503)
        head = {"status": "ok", "model": model_name, "model_version": model_version, "instance": instance}
        if keyed is not None and not keyed.holds(request):  # open to all: the status, not the load
            return Response(head)
        # `stats` is what the gateway's supervisor reads into its per-replica engine gauges
        s = engine.stats()
        total = s.num_kv_blocks_total or 1
        stats = {"kv_utilisation": s.num_kv_blocks_used / total,
                 "kv_utilisation_others": s.num_kv_blocks_used_by_others / total,  # the ladder's: no one tenant's
                 "tokens_per_s": s.generation_tokens_per_s, "num_running": s.num_running,
                 "num_waiting": s.num_waiting, "prefix_cache_hit_rate": s.prefix_cache_hit_rate}
        return Response({**head, "stats": stats})

    @get("/v1/models")
    async def models(request: Request[Any, Any, Any]) -> Any:
        if (refused := _query_refusal(request)) is not None:
            return refused
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "tiergate-engine",
            "max_model_len": engine.max_model_len, "model_version": model_version,
        }]}

    @get("/metrics")
    async def metrics() -> Response[bytes]:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        return await serve(request, ChatCompletionRequest)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await serve(request, CompletionRequest)

    return Litestar(route_handlers=[health, models, metrics, chat, completions],
                    exception_handlers={HTTPException: _http_error, Exception: _unexpected},
                    request_max_body_size=max_body_bytes, before_request=keyed.guard if keyed else None)


def _unknown_model(asked: str, served: str) -> Response[Any]:
    """A request for a model this engine does not serve: 404 as OpenAI's and vLLM's, before anything is tokenized."""
    return Response(error_body(f"The model `{asked}` does not exist; this engine serves `{served}`",
                               param="model", code="model_not_found"), status_code=404)


def _query_refusal(request: Request[Any, Any, Any]) -> Response[Any] | None:
    """A 400 naming the first parameter of the request's query (these routes take none), or None without one."""
    query = request.scope.get("query_string", b"")
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True) if query else []
    if not pairs:
        return None
    name = pairs[0][0][:64]
    return Response(error_body(f"{name}: unsupported query parameter (this route takes none: a request's parameters "
                               "go in its JSON body); remove it", param=name, code="unsupported_parameter"),
                    status_code=400)


def _encoding_refusal(request: Request[Any, Any, Any]) -> Response[Any] | None:
    """A 415 for a body sent encoded (gzip, deflate...): it is read as it comes, so it could only be refused as broken
    JSON; None for one sent as it is."""
    if request.headers.get("content-encoding", "identity").strip(" \t").lower() in ("", "identity"):
        return None
    return Response(error_body("a Content-Encoding other than identity is not supported; send the body uncompressed",
                               code="unsupported_content_encoding"), status_code=415)


def _dead(reason: str) -> Response[Any]:
    return Response(error_body(reason, "api_error", code="engine_dead"), status_code=503,
                    headers={"retry-after": "1"})


def _http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    if exc.status_code == 413:
        return Response(error_body(f"the request body is larger than this engine accepts "
                                   f"({request.app.request_max_body_size} bytes)", code=PAYLOAD_TOO_LARGE),
                        status_code=413)
    if exc.status_code >= 500:
        return Response(error_body(str(exc.detail), "api_error", code="engine_error"), status_code=exc.status_code)
    return Response(error_body(str(exc.detail)), status_code=exc.status_code)


def _unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """A bug, not the request: OpenAI's shape, no internals."""
    log.error("an unexpected error answering a request", exc_info=exc)
    return Response(FAILED, status_code=500)
