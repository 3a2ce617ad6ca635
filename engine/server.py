"""The engine's own OpenAI-compatible HTTP server: /v1/chat/completions, /v1/models, /health, /metrics.

It speaks the same API as vLLM (its `priority` field included), so the gateway's one tier client serves
local engines and remote ones alike. Each response also carries `x_tiergate.busy_s`, the engine compute
time attributed to the request, which the gateway turns into compute cost.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError

from engine.llm_engine import EngineInputError, LLMEngine, RequestOutput
from engine.protocol import ChatCompletionRequest, error_body
from engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 1024  # without max_tokens: up to this, or what the context has left


def sampling_params_for(req: ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    default_cap = max(1, min(DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens))
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        max_tokens=req.output_cap or default_cap,
        seed=req.seed,
        stop=req.stop_list,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
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
            ("tiergate_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.num_prefix_query_tokens_total),
            ("tiergate_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.num_prefix_hit_tokens_total),
            ("tiergate_engine_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions_total),
        ):
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric([self.model], value)
            yield c


def create_engine_app(engine: LLMEngine, *, model_name: str, model_version: str) -> Litestar:
    tokenizer = engine.tokenizer
    registry = CollectorRegistry()
    registry.register(EngineMetrics(engine, model_name))

    def prompt_ids(req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    @get("/health")
    async def health() -> dict[str, Any]:
        # `stats` is what the gateway's supervisor reads into its per-replica engine gauges
        s = engine.stats()
        stats = {"kv_utilisation": s.num_kv_blocks_used / s.num_kv_blocks_total if s.num_kv_blocks_total else 0.0,
                 "tokens_per_s": s.generation_tokens_per_s, "num_running": s.num_running,
                 "num_waiting": s.num_waiting, "prefix_cache_hit_rate": s.prefix_cache_hit_rate}
        return {"status": "ok", "model": model_name, "model_version": model_version, "stats": stats}

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "tiergate-engine",
            "max_model_len": engine.max_model_len, "model_version": model_version,
        }]}

    @get("/metrics")
    async def metrics() -> Response[bytes]:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            req = ChatCompletionRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            return Response(error_body(f"{param}: {err['msg']}" if param else err["msg"], param=param),
                            status_code=400)
        ids = prompt_ids(req)
        params = sampling_params_for(req, len(ids), engine.max_model_len)
        try:
            engine.validate(ids, params)
        except EngineInputError as exc:
            return Response(error_body(str(exc), param="messages", code="context_length_exceeded"),
                            status_code=400)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = engine.generate(ids, params, request_id=rid, priority=req.priority)
        if req.stream:
            return Stream(_sse(outputs, rid, model_name, req.include_usage, req.continuous_usage, tokenizer),
                          media_type="text/event-stream",
                          headers={"cache-control": "no-cache"})
        return Response(await _collect(outputs, rid, model_name, tokenizer))

    return Litestar(route_handlers=[health, models, metrics, chat],
                    exception_handlers={HTTPException: _http_error})


def _http_error(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    return Response(error_body(str(exc.detail)), status_code=exc.status_code)


def _usage(out: RequestOutput) -> dict[str, int]:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}


def _logprobs(tokenizer: Any, out: RequestOutput) -> list[dict[str, Any]] | None:
    """OpenAI's `logprobs.content` entries for the tokens of `out`, when the request asked for them."""
    if out.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]}
            for t, (lp, top) in zip(out.token_ids, out.logprobs, strict=True)]


async def _collect(outputs: AsyncIterator[RequestOutput], rid: str, model: str, tokenizer: Any) -> dict[str, Any]:
    parts: list[str] = []
    last: RequestOutput | None = None
    content: list[dict[str, Any]] | None = None
    async for out in outputs:
        parts.append(out.text)
        last = out
        if (lps := _logprobs(tokenizer, out)) is not None:
            content = (content or []) + lps
    assert last is not None
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                     "finish_reason": last.finish_reason,
                     "logprobs": {"content": content} if content is not None else None}],
        "usage": _usage(last), "x_tiergate": {"busy_s": last.busy_s},
    }


async def _sse(outputs: AsyncIterator[RequestOutput], rid: str, model: str,
               include_usage: bool, continuous_usage: bool, tokenizer: Any) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, lps: list[dict[str, Any]] | None = None,
              **extra: Any) -> bytes:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                             "logprobs": {"content": lps} if lps is not None else None}], **extra}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    async for out in outputs:
        lps = _logprobs(tokenizer, out)
        if not out.finished:
            if continuous_usage:
                yield chunk({"content": out.text}, None, lps, usage=_usage(out), x_tiergate={"busy_s": out.busy_s})
            elif out.text or lps:
                yield chunk({"content": out.text}, None, lps)
            continue
        if out.text or lps:
            yield chunk({"content": out.text}, None, lps)
        yield chunk({}, out.finish_reason, x_tiergate={"busy_s": out.busy_s})
        if include_usage:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": _usage(out), "x_tiergate": {"busy_s": out.busy_s}}
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
