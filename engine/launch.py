"""Build an engine from a model source and serve it: what `tiergate engine serve` runs."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assets import offline_hub
from assets.engine_key import ENGINE_API_KEY_ENV
from assets.model_source import prepare_model
from assets.parent_watch import ENGINE_INSTANCE_ENV, exit_when_orphaned
from engine.engine_auth import check_exposure
from engine.llm_engine import LLMEngine
from engine.weight_digest import weights_digest

# 0.3: int8 on CPU runs fbgemm with per-token activations; 0.4: oneDNN linear layers and fused layer steps
# (the same sums in another order: a near-tie can now pick the other token); 0.5: bf16 on CPU keeps fp32
# activations around bf16 matmuls (engine/model_runner.py); 0.6: a speculative tier's draft catches up with a long
# prompt a share a step, the sequence decoding plainly meanwhile (engine/speculative.py): a seeded sampled answer to
# a long prompt draws its numbers in another order; 0.7: a speculative tier's sequence drafts only where it pays
# (engine/draft_cost.py): a seeded sampled answer to a long prompt, or a short answer, draws as plain decoding does;
# 0.8: a seeded request draws from numpy's PCG64, seeded by all 64 bits (engine/sampler.py), not torch's mt19937,
# seeded by the low 32: every seeded sampled answer draws other numbers
ENGINE_VERSION = "tiergate-engine/0.8"
# the int8 tier's activation scheme: each token mapped onto [0, 1] before fbgemm (engine/int8_dynamic.py), since
# 2026-12-02; its answers differ from the scheme before, so its versions do
INT8_SCHEME = "rows-onto-0-1"
# `max_num_seqs` auto: as many sequences as the KV cache holds at this many tokens each (a ShareGPT prompt and
# its reply fit; the gateway reserves 1,024 output tokens by default), capped at vLLM's default. The gateway
# sizes its dispatch slots with the same rule (tiers/supervisor.py; tests/tiers/test_engine_capacity.py).
TYPICAL_REQUEST_TOKENS = 1024
MAX_NUM_SEQS_CAP = 256
# the files of a model directory besides its weights whose contents change answers (config.json is required)
ANSWER_FILES = ("config.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "merges.txt", "model.safetensors.index.json")
log = logging.getLogger("tiergate.engine")


def kv_max_num_seqs(num_kv_blocks: int, block_size: int) -> int:
    """Sequences of TYPICAL_REQUEST_TOKENS the KV cache holds at once: at least 1, at most MAX_NUM_SEQS_CAP."""
    blocks_per_seq = -(-TYPICAL_REQUEST_TOKENS // block_size)
    return max(1, min(MAX_NUM_SEQS_CAP, num_kv_blocks // blocks_per_seq))


@dataclass(frozen=True)
class DraftModel:
    """A speculative draft for the engine's model (engine/speculative.py): a model with the same tokenizer."""

    model: str  # a built-in name or a local directory, as the engine's own
    quantize: str | None = None
    dtype: str = "auto"
    k: int = 4
    max_batch: int = 4
    kv_cache_bytes: int = 128 << 20  # the draft's own KV cache (a sequence that does not fit is not drafted)

    def describe(self) -> str:
        return f"{Path(self.model).name}:{self.quantize}:{self.dtype}:k{self.k}"


def model_version(model_dir: Path, *, dtype: str, quantize: str | None, kv_cache_dtype: str = "auto",
                  draft: str | None = None) -> str:
    """A fingerprint of everything the answers depend on: the weights' contents, the files that turn messages into
    tokens and back (ANSWER_FILES: config, chat template, tokenizer, generation defaults), precision and engine.

    The weights count by content (engine/weight_digest.py): names and sizes alone stay the same when a student is
    re-distilled or a fine-tune is copied over the model in place, and the old answers would stay reachable. Their
    sha256 is recorded beside them once and reused while each file's size, mtime, ctime and inode are unchanged,
    so a start hashes gigabytes only when the weights changed (a full hash, not a sample of blocks: a fine-tune
    may change only a few tensors). The small files are hashed whole at every start.

    `draft` (DraftModel.describe) counts too: greedy answers are the same with or without it, but a seeded sampled
    answer draws its random numbers in another order."""
    h = hashlib.sha256()
    for name in ANSWER_FILES:
        if (path := model_dir / name).is_file():
            data = path.read_bytes()
            h.update(f"{name}:{len(data)}:".encode())
            h.update(data)
    h.update(f"weights={weights_digest(model_dir)}|".encode())
    h.update(f"{dtype}|{quantize}|{ENGINE_VERSION}".encode())
    if quantize == "int8":
        h.update(f"|{INT8_SCHEME}".encode())
    if kv_cache_dtype != "auto":  # a narrower KV cache changes answers (auto keeps the versions it always had)
        h.update(f"|kv={kv_cache_dtype}".encode())
    if draft is not None:
        h.update(f"|draft={draft}".encode())
    return h.hexdigest()[:16]


def _same_tokenizer(a: Any, b: Any) -> bool:
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids


def build_engine(model: str, models_dir: Path, *, dtype: str = "auto", quantize: str | None = None,
                 device: str = "cpu", max_num_seqs: int | None = None, threads: int | None = None,
                 kv_cache_bytes: int | None = None, max_num_batched_tokens: int = 512,
                 kv_cache_dtype: str = "auto", draft: DraftModel | None = None,
                 max_waiting: int | None = None) -> tuple[LLMEngine, str]:
    """Load `model` (a built-in name or a local directory); returns the engine and its model version.

    `kv_cache_bytes` is the KV cache's fixed budget (default: the runner's, 512 MiB), allocated once;
    `max_num_seqs` None sizes the batch to it (`kv_max_num_seqs`). `draft`: speculative decoding with that model
    (ValueError when its tokenizer is not the model's). `max_waiting`: requests in flight beyond `max_num_seqs` before
    a new one is a 429 (None: LLMEngine's default, WAITING_PER_SLOT per slot).
    """
    offline_hub()
    import torch
    from transformers import AutoTokenizer

    from engine.model_runner import DEFAULT_KV_CACHE_BYTES, ModelRunner

    if threads:
        torch.set_num_threads(threads)
    model_dir = prepare_model(model, models_dir)
    runner = ModelRunner(model_dir, dtype=dtype, device=device, quantize=quantize,
                         kv_cache_bytes=kv_cache_bytes or DEFAULT_KV_CACHE_BYTES, kv_cache_dtype=kv_cache_dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_num_seqs = max_num_seqs or kv_max_num_seqs(runner.num_kv_blocks, runner.block_size)
    speculative = None
    if draft is not None:
        from engine.speculative import SpeculativeConfig, SpeculativeDecoder

        draft_dir = prepare_model(draft.model, models_dir)
        if not _same_tokenizer(AutoTokenizer.from_pretrained(draft_dir), tokenizer):
            raise ValueError(f"the draft model {draft.model} has another tokenizer than {model}; a draft must "
                             "propose the target's tokens")
        draft_runner = ModelRunner(draft_dir, dtype=draft.dtype, device=device, quantize=draft.quantize,
                                   kv_cache_bytes=draft.kv_cache_bytes)
        speculative = SpeculativeDecoder(runner, draft_runner, SpeculativeConfig(k=draft.k, max_batch=draft.max_batch))
    engine = LLMEngine(runner, tokenizer, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       speculative=speculative, max_waiting=max_waiting)
    version = model_version(model_dir, dtype=str(runner.dtype).removeprefix("torch."), quantize=quantize,
                            kv_cache_dtype=kv_cache_dtype, draft=draft.describe() if draft else None)
    log.info("engine loaded %s (%s, %s, %d KV blocks of %d tokens, up to %d sequences at once, %d torch threads) "
             "version %s", model_dir, runner.dtype, quantize or "no quantization", runner.num_kv_blocks,
             runner.block_size, max_num_seqs, torch.get_num_threads(), version)
    if draft is not None:
        log.info("speculative decoding: draft %s proposes %d tokens a step while at most %d sequences decode",
                 draft.describe(), draft.k, draft.max_batch)
    return engine, version


def serve(model: str, models_dir: Path, *, host: str, port: int, served_name: str | None = None,
          dtype: str = "auto", quantize: str | None = None, device: str = "cpu", max_num_seqs: int | None = None,
          threads: int | None = None, kv_cache_bytes: int | None = None, max_num_batched_tokens: int = 512,
          kv_cache_dtype: str = "auto", draft: DraftModel | None = None, max_body_bytes: int | None = None,
          api_key_env: str = ENGINE_API_KEY_ENV, allow_unauthenticated: bool = False,
          max_waiting: int | None = None) -> None:
    """`max_body_bytes`: the largest request body served (None: engine/server.py's default, the gateway's).
    `api_key_env`: the environment variable holding the key every route but /health requires; unset, a host beyond
    this machine is refused unless `allow_unauthenticated` (engine/engine_auth.py). Checked before the model loads."""
    import uvicorn

    from engine.server import create_engine_app

    api_key = os.environ.get(api_key_env) or None
    check_exposure(host, api_key, allow_unauthenticated=allow_unauthenticated, key_env=api_key_env)
    if os.environ.get(ENGINE_INSTANCE_ENV):  # started by the gateway's supervisor: never outlive it
        exit_when_orphaned()
    engine, version = build_engine(model, models_dir, dtype=dtype, quantize=quantize, device=device,
                                   max_num_seqs=max_num_seqs, threads=threads, kv_cache_bytes=kv_cache_bytes,
                                   max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype,
                                   draft=draft, max_waiting=max_waiting)
    name = served_name or Path(model).name
    limit = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    app = create_engine_app(engine, model_name=name, model_version=version, api_key=api_key, **limit)
    engine.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        engine.shutdown()
