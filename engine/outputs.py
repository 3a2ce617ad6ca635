"""What the engine hands its callers: each request's outputs as they are made, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    text: str  # text made since the previous output
    token_ids: list[int]  # tokens made since the previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    busy_s: float  # engine compute time attributed to the request so far
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # per token in `token_ids`, when the request asked: (log-probability, [(token id, log-probability)] top others)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # on the last output of a request the engine could not finish: why, and "engine_error" (its step failed,
    # the engine serves on) or "engine_dead" (the loop stopped)
    error: str | None = None
    error_code: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    busy_s_total: float
    num_requests_finished: int
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0  # held by a running sequence
    num_kv_blocks_free: int = 0  # idle (some still hold a reusable prefix)
    num_kv_blocks_used_by_others: int = 0  # held by sequences of every tenant (cache salt) but the one holding most
    num_prefix_query_tokens_total: int = 0
    num_prefix_hit_tokens_total: int = 0
    num_preemptions_total: int = 0
    generation_tokens_per_s: float = 0.0  # over the last THROUGHPUT_WINDOW_S seconds (engine/llm_engine.py)
    num_requests_failed: int = 0  # ended by an engine error, not by the request
    num_speculative_steps_total: int = 0  # steps a draft model proposed tokens in (engine/speculative.py)
    num_draft_tokens_total: int = 0  # tokens it proposed
    num_accepted_draft_tokens_total: int = 0  # of those, tokens the model kept

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.num_prefix_query_tokens_total
        return self.num_prefix_hit_tokens_total / q if q else 0.0
