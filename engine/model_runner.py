"""Runs one scheduled step on the model: builds the flat batch, runs our Llama forward, samples.

With the sampler and the model, this is the engine's torch code. The KV cache is allocated here once,
to a byte budget, as [layers, 2, num_blocks, block_size, KV heads, head_dim]; the block manager hands
out indices into it. Each step the runner puts single-token sequences (decodes) first so attention can
batch them, flattens all new tokens into one [N] batch for the linear layers, and computes logits only
for the sequences that sample. A step of decodes only, on a CPU model with oneDNN-packed fp32 layers or the
int8 tier's, runs every layer in one native call (engine/decode_step.py).

On CPU every row of a step, a prompt's as well as a decode's, is attended as a decode: over its own context alone,
by the same code (the native decode kernel, or SDPA one row at a time). A row's sums then do not depend on how its
prompt was cut: prefilled whole, in chunks, after a prefix-cache hit of any length (its K/V from a prompt of
another length) or, for a one-token remainder, in a decode step, it comes out bit for bit the same, so the same
greedy request asked twice gets the same answer. SDPA's fused kernel over a whole chunk sized its query and key
blocks by the chunk's and the context's lengths and masked a later chunk otherwise than a whole prompt, one to a
few ulps apart (enough to change an int8 answer; tests/engine/test_prefix_cache_bits.py). Attending row by row
costs long prompts time (a row reads its K/V alone, where the fused kernel shared them; without the native kernel
a chunk's rows share one gather of its K/V but each is still its own SDPA call); CUDA keeps one SDPA call per
prompt chunk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from assets.model_dtype import auto_dtype
from engine import int8_dynamic, onednn_linear
from engine.attention import AttentionMetadata
from engine.decode_step import NativeDecodeStep
from engine.grammar import GrammarError, GrammarLimitError
from engine.kernels import native as native_kernels
from engine.layer_ops import NativeLayerOps
from engine.models.llama import LlamaConfig, LlamaForCausalLM
from engine.quantize import quantize_int8_
from engine.sampler import Sampler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from wire.errors import RESPONSE_FORMAT_FAILED

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_KV_CACHE_BYTES = 512 << 20  # SmolLM2 in fp32: 11,800 tokens, more than its 8,192-token context
DEFAULT_BLOCK_SIZE = 16


def resolve_dtype(name: str, device: str, quantize: str | None = None) -> torch.dtype:
    """`auto`: assets/model_dtype.py's choice for the device and quantization (bf16 on CUDA and fast-bf16 CPUs, but
    fp32 activations for an int8 model on x86); otherwise the dtype named."""
    if name == "auto":
        return DTYPES[auto_dtype(device, quantize)]
    try:
        return DTYPES[name]
    except KeyError as exc:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}") from exc


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's (auto), or bf16 under an fp32 model."""
    kv = model_dtype if name == "auto" else DTYPES.get(name)
    if kv == model_dtype or (kv == torch.bfloat16 and model_dtype == torch.float32):
        return kv
    raise ValueError(f"KV cache dtype {name!r} is not supported for a {model_dtype} model; expected auto, "
                     "or bf16 under an fp32 model")


class ModelRunner:
    def __init__(self, model_dir: Path, *, dtype: str = "auto", device: str = "cpu", quantize: str | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_dtype: str = "auto") -> None:
        """`kv_cache_dtype`: auto keeps K/V in the model's dtype (fp32 greedy output then equals transformers');
        bf16 under an fp32 model halves the bytes every decode step reads (and doubles the tokens a budget holds)."""
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device, quantize)  # the weights' in every matmul
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        # bf16 on a CPU where oneDNN runs bf16: bf16 weights in the matmuls (half the bytes a decode step reads,
        # AVX-512 BF16 / AMX), fp32 for the rest (norms, rope, attention, residuals), so the native decode step
        # and the fused layer ops, written for fp32, serve it too; elsewhere (CUDA, no oneDNN) the whole model is
        # in the dtype
        self.activation_dtype = self.dtype
        if self.dtype == torch.bfloat16 and quantize is None and onednn_linear.available(self.device, self.dtype):
            self.activation_dtype = torch.float32
        self.config = cfg = LlamaConfig.from_dir(model_dir)
        model = LlamaForCausalLM.empty(cfg, self.activation_dtype)
        model.load_weights(model_dir)
        if quantize == "int8" and int8_dynamic.available(self.device, self.dtype):
            # fbgemm with per-token activations (x86 CPUs), calibrated on ShareGPT text
            int8_dynamic.quantize_int8_dynamic_(model, int8_dynamic.calibration_chunks(model_dir), model_dir)
        elif quantize == "int8":
            quantize_int8_(model)  # weight-only, dequantized into the matmul (CUDA, other CPUs)
        elif quantize is not None:
            raise ValueError(f"unknown quantization {quantize!r}; expected int8")
        self.model = model.to(self.device).eval()
        if onednn_linear.available(self.device, self.activation_dtype):
            # the layers and head: about 2x MKL's at few rows in fp32
            onednn_linear.pack_linears_(self.model, self.dtype)
        self.block_size = block_size
        bytes_per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * \
            self.kv_dtype.itemsize
        self.num_kv_blocks = kv_cache_bytes // bytes_per_block
        if self.num_kv_blocks < 1:
            raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds no block of {bytes_per_block} bytes")
        # allocated once and zeroed (a masked slot must never hold NaN): admission never grows it
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, 2, self.num_kv_blocks, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, dtype=self.kv_dtype, device=self.device)
        self.max_model_len = min(cfg.max_position_embeddings, self.num_kv_blocks * block_size)
        self.eos_token_ids = _eos_ids(model_dir)
        self.sampler = Sampler()
        # on CPU the native kernels (compiled once per machine) read the paged cache in place for decodes and
        # fuse the steps between a layer's matmuls; CUDA, and a CPU without a compiler, use torch's ops
        self.decode_kernel = native_kernels.load() if self.device.type == "cpu" else None
        if self.decode_kernel is not None:
            self.model.ops = NativeLayerOps(self.decode_kernel)
        # a step of decodes only, with oneDNN-packed fp32 layers or the int8 tier's: every layer in one native call
        self.native_decode = NativeDecodeStep.of(self.model, self.decode_kernel)
        # request id -> (made token's log-probability, [(token id, log-probability)] top alternatives), for the
        # sequences of the last `run` that asked for logprobs
        self.last_logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = {}
        self.last_errors: dict[str, str] = {}  # request id -> why its sampling failed, in the last `run`
        # request id -> the error code of a failure that is the request's own (its grammar), in the last `run`
        self.last_error_codes: dict[str, str] = {}
        self.last_grammar_limits: set[str] = set()  # request ids whose grammar ran past its limits, in the last `run`

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int]:
        """Compute the scheduled tokens; return one sampled token per sequence with `do_sample`, in order. An empty
        schedule (the engine's loop never runs one, other callers may) computes nothing and returns []."""
        self.last_logprobs = {}
        self.last_errors = {}
        self.last_error_codes = {}
        self.last_grammar_limits = set()
        if not out.seqs:
            return []
        order = sorted(range(len(out.seqs)), key=lambda i: out.num_scheduled_tokens[i] != 1)  # decodes first
        seqs = [out.seqs[i] for i in order]
        counts = [out.num_scheduled_tokens[i] for i in order]
        input_ids, positions, meta, last_index = self._prepare(seqs, counts)
        if self.native_decode is not None and len(input_ids) == len(seqs):  # decodes only
            hidden = self.native_decode(input_ids, positions, self.kv_cache, meta)  # [N, hidden]
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
        samplers = [i for i in order if out.do_sample[i]]  # original indices, in batch order
        if not samplers:
            return []
        batch_pos = {i: k for k, i in enumerate(order)}
        rows = torch.tensor([last_index[batch_pos[i]] for i in samplers], dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows]).float().cpu()  # [S, V]
        best = logits.argmax(dim=-1)  # [S]
        greedy = best.tolist()
        # a row holding NaN (a numeric fault in the forward pass) has no next token: argmax and the sampler's draw
        # would each pick an arbitrary index from it and go on, so its sequence fails instead (alone, below). argmax
        # propagates NaN (torch's max does: the index is a NaN's), so the row's maximum is NaN exactly when the row
        # holds one: read at S indices, where `isnan().any()` over [S, V] cost as much again as the argmax (0.87 ms
        # against 0.66 at 16 rows of SmolLM2's 49,152 on one core; 5 us this way)
        nan_rows = logits.gather(1, best.unsqueeze(1)).squeeze(1).isnan().tolist()  # [S]
        token_of = {}
        for row, i in enumerate(samplers):
            seq = out.seqs[i]
            # one sequence's failure (its sampler, its logprobs) is its own: it gets token -1 and its error in
            # `last_errors`, and the engine fails it alone while the others keep their tokens
            try:
                if nan_rows[row]:
                    raise FloatingPointError("the model's logits for this sequence hold NaN")
                # the sampler gets the output so far (what penalties count); logits[row] stays the model's (logprobs)
                token_of[i] = greedy[row] if seq.params.greedy else \
                    self.sampler.sample(seq.request_id, logits[row], seq.params, seq.output_token_ids)
                if seq.params.logprobs is not None:
                    self.last_logprobs[seq.request_id] = _logprobs(logits[row], token_of[i], seq.params.logprobs)
            except Exception as exc:
                token_of[i] = -1
                self.last_errors[seq.request_id] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, GrammarError):  # the tenant's schema, not the engine, could not go on
                    self.last_error_codes[seq.request_id] = RESPONSE_FORMAT_FAILED
                if isinstance(exc, GrammarLimitError):  # the schema's fault: its later requests are refused early
                    self.last_grammar_limits.add(seq.request_id)
        return [token_of[i] for i in sorted(samplers)]

    @torch.inference_mode()
    def logits_of_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                       wanted: list[int]) -> torch.Tensor:
        """One step of single-token rows; float32 logits [len(wanted), V] of the rows listed in `wanted`.

        Row r is token_ids[r] at positions[r] of a sequence whose blocks are block_tables[r]: its K/V are written to
        its slot and it attends to every position up to its own. Rows of one sequence at consecutive positions
        (sharing its block table) therefore compute what a prompt chunk would, through the decode kernels a plain
        decode step uses (every row's K/V are written before any row attends, layer by layer). The speculative
        decoder (engine/speculative.py) runs its drafts and its verification this way.
        """
        if not token_ids:  # no rows: nothing to compute
            return torch.empty(0, self.config.vocab_size)
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions, strict=True)]
        meta = self._metadata(slots, [(table, [p + 1]) for table, p in zip(block_tables, positions, strict=True)])
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.native_decode is not None:
            hidden = self.native_decode(ids, pos, self.kv_cache, meta)
        else:
            hidden = self.model(ids, pos, self.kv_cache, meta)
        if not wanted:
            return torch.empty(0, self.config.vocab_size)
        rows = torch.tensor(wanted, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]).float().cpu()

    def release(self, request_id: str) -> None:
        self.last_logprobs.pop(request_id, None)
        self.sampler.release(request_id)

    def _prepare(self, seqs: list[Sequence], counts: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        rows_alone = self.device.type == "cpu"  # every row attended as a decode (the module's docstring)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: list[int] = []
        decodes: list[tuple[list[int], list[int]]] = []
        starts, lens, tables, ctxs = [], [], [], []
        for seq, n in zip(seqs, counts, strict=True):
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + n]
            if n == 1 or rows_alone:
                decodes.append((seq.block_table, list(range(start + 1, start + n + 1))))
            else:
                starts.append(len(input_ids))
                lens.append(n)
                tables.append(torch.tensor(seq.block_table[:-(-(start + n) // bs)], dtype=torch.long,
                                           device=self.device))
                ctxs.append(start + n)
            input_ids += tokens
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            last_index.append(len(input_ids) - 1)
        meta = self._metadata(slots, decodes, (starts, lens, tables, ctxs))
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta, last_index)

    def _metadata(self, slots: list[int], decodes: list[tuple[list[int], list[int]]],
                  prefills: tuple[list[int], list[int], list[torch.Tensor], list[int]] = ([], [], [], [])
                  ) -> AttentionMetadata:
        """The step's attention metadata. `decodes`: the rows attended as decodes (the step's first rows), as each
        sequence's block table with its rows' contexts (rows of one sequence share its table, cut to their longest
        context); `prefills`: the prompt chunks attended whole (CUDA)."""
        bs = self.block_size
        context_lens = [ctx for _, row_ctxs in decodes for ctx in row_ctxs]
        max_ctx = max(context_lens, default=0)
        table = torch.zeros(len(context_lens), -(-max_ctx // bs), dtype=torch.long)
        row = 0
        for blocks, row_ctxs in decodes:
            used = -(-max(row_ctxs) // bs)
            table[row:row + len(row_ctxs), :used] = torch.tensor(blocks[:used])
            row += len(row_ctxs)
        mask = None
        # the padding mask of CUDA's batched SDPA; none when every context is as long (CPU attends each row alone)
        if self.device.type != "cpu" and any(n != max_ctx for n in context_lens):
            mask = torch.arange(max_ctx)[None, :] < torch.tensor(context_lens)[:, None]  # [B, ctx]
            mask = mask[:, None, None, :].to(self.device)
        starts, lens, tables, ctxs = prefills
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device), num_decode_seqs=len(context_lens),
            decode_block_tables=table.to(self.device), decode_mask=mask, decode_context_len=max_ctx,
            decode_context_lens=torch.tensor(context_lens, dtype=torch.long, device=self.device),
            decode_kernel=self.decode_kernel,
            prefill_query_starts=starts, prefill_query_lens=lens, prefill_block_tables=tables,
            prefill_context_lens=ctxs,
        )


def _eos_ids(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids



def _logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's own log-probabilities (before temperature and top-k/p, as OpenAI and vLLM report them)."""
    logp = torch.log_softmax(logits, dim=-1)
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logp, top)
        alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logp[token]), alternatives
