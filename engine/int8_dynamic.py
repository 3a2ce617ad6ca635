"""The int8 `mid` tier's fast CPU path: fbgemm's u8 x s8 kernels with per-token activation scales.

Each choice below was measured on SmolLM2-135M (teacher-forced top-1 agreement with fp32 on held-out
ShareGPT text; `python -m bench.int8_variants`):
- fbgemm quantizes a whole activation tensor with one scale (torch's defaults: 44%). Each row is divided by
  its own absolute maximum first and multiplied back after, which makes the scale per token (79%).
- The LM head keeps fp16 weights (fbgemm's fp16 kernel): it is the projection int8 hurts most (82%).
- fbgemm multiplies u8 activations by s8 weights in pairs summed into int16 (AVX2 `vpmaddubsw`), which
  saturates unless activations or weights give up a bit; torch's default gives up an activation bit.
  8-bit activations with 7-bit weights (|q| <= 63, per output channel) lose less (88%).
- SmoothQuant (alpha 0.5): part of each input channel's activation range moves into the weights, folded
  into the RMSNorm weights before q/k/v and gate/up, and into up_proj's rows before down_proj (93%).
- The input channels with the largest calibrated activations (32; 64 for down_proj) stay in fp32 in a
  small side matmul, so they do not set the other channels' scale (95%).
- fbgemm picks one asymmetric range (min, max) for the whole activation tensor, so with rows divided by their
  largest |value| a row's rounding still depended on the rows beside it: a prompt prefilled whole or its last
  tokens after a prefix-cache hit, a sequence decoded alone or in a batch, came out differently (on an AMD Zen 4
  the same question asked twice got two answers, one of them wrong). Each row is now mapped affinely onto
  exactly [0, 1] (x - min) / (max - min), so the tensor's range is [0, 1] whatever is batched together: every
  token is quantized over its own range, alone, and the product is undone as y * span + min * (the int8
  weights' row sums).
- Without the native kernels, the fp32 outlier product ran as one BLAS matmul (addmm), whose kernel, and with it
  each sum's order, MKL picks by the number of rows (measured: 1, 2, 3, 5 or 7 rows summed otherwise than 4, 8
  or 37): a prompt's last token came out one ulp apart prefilled whole or after a prefix-cache hit, enough to move
  a later int8 rounding (SmolLM2 answered "L'Étoile" once, then Paris). It runs on fbgemm's fp16 kernel instead
  (but see its kernel sizes below): the fp32 weights split into an fp16 high part and an fp16 remainder (scaled
  by a power of two into fp16's range), side by side along the inputs, ~fp32's precision.
- fbgemm's fp16 kernel does not sum alike for every number of rows either: it cuts a call's rows into kernels of
  1 to 6 rows (14 with AVX-512) by a fixed table, and on an AMD Zen 3 (AVX2) its 1- and 2-row kernels round
  otherwise than its 3- to 6-row ones (one row alone, 2 rows, or the 1 or 2 left over of 7, 14, 31, 32, 37 or 38
  rows: measured over 1 to 40 rows). A prompt's rows came out apart prefilled whole or after a prefix-cache hit
  (17 of 35 (prompt, cached) lengths answered otherwise on the torch ops). The side matmul's rows are now padded
  with zero rows to a multiple of 6, which that table cuts into 6-row kernels only (120-row blocks included): each
  row is summed by the same kernel whatever is batched beside it, at the same precision (measured cost in
  `python -m bench.int8_rows`).
Calibration reads ShareGPT first turns (not the held-out tail the benchmark measures on).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.int8_ranges import cached_ranges
from engine.kernels import native as native_kernels

SMOOTH_ALPHA = 0.5
OUTLIERS = {"down_proj": 64}  # fp32 input channels per projection; the others keep DEFAULT_OUTLIERS
DEFAULT_OUTLIERS = 32
WEIGHT_QMAX = 63  # 7-bit weights: u8 x s8 pair sums stay inside int16 with 8-bit activations
CALIBRATION_TOKENS = 2048
CHUNK = 512
FP16_KERNEL_ROWS = 6  # rows per fbgemm fp16 kernel: the torch ops' side matmul is padded to a multiple of it


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """fbgemm's kernels exist on x86 CPUs and take fp32 activations."""
    return device.type == "cpu" and dtype == torch.float32 and "fbgemm" in torch.backends.quantized.supported_engines


class Int8DynamicLinear(nn.Module):
    """y = W x with W in 7-bit per output channel, x quantized to 8 bits per token, outlier channels in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, outliers: torch.Tensor, *,
                 per_token: bool = True, weight_qmax: int = WEIGHT_QMAX) -> None:
        """`per_token=False` and `weight_qmax=127` (7-bit activations then) are the weaker schemes that
        bench/int8_variants.py measures; the tier uses the defaults."""
        super().__init__()
        self.per_token, self.reduce_range = per_token, weight_qmax > WEIGHT_QMAX  # 8-bit weights: 7-bit activations
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        keep = torch.ones(self.in_features, dtype=torch.bool)
        keep[outliers] = False
        self.register_buffer("outliers", outliers.clone())
        self.register_buffer("keep", keep.float())  # multiplies the activations: 0 at the fp32 channels
        self.register_buffer("w_outliers", w[:, outliers].t().contiguous())  # [k, out]
        self.outliers_fp16, self.outliers_scale = _pack_fp32_as_fp16_pair(w[:, outliers])  # the torch ops' side matmul
        # the per-token steps and the outlier side matmul fused in C++ (engine/kernels/int8_rows.cpp) where it exists
        self.kernels = native_kernels.load() if per_token and w.device.type == "cpu" else None
        w_int = w * keep
        scale = w_int.abs().amax(dim=1).clamp(min=1e-8) / weight_qmax
        qweight = torch.quantize_per_channel(w_int, scale.double(), torch.zeros(self.out_features, dtype=torch.long),
                                             0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.register_buffer("w_rowsum", qweight.dequantize().sum(dim=1).float().contiguous())  # [out]
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if self.kernels is not None and x.dtype == torch.float32:
            normed, scales, kept = self.kernels.int8_rows_prepare(x.contiguous(), self.outliers)
            y = torch.ops.quantized.linear_dynamic(normed, self.packed, self.reduce_range)
            y = self.kernels.int8_rows_finish_(y, scales, kept, self.w_outliers, self.w_rowsum)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)
        xm = x * self.keep
        if self.per_token:  # each row onto exactly [0, 1]: fbgemm's one range is then every row's own
            lo, hi = xm.aminmax(dim=-1, keepdim=True)
            span = (hi - lo).clamp(min=1e-12)
            unit = ((xm - lo) * (1.0 / span)).clamp_(0.0, 1.0)  # times the reciprocal, as the fused kernel does
            unit.scatter_(1, xm.argmin(dim=-1, keepdim=True), 0.0)
            unit.scatter_(1, xm.argmax(dim=-1, keepdim=True), ((hi - lo) > 1e-12).to(unit.dtype))
            y = torch.ops.quantized.linear_dynamic(unit, self.packed, self.reduce_range)
            # y * span + min * row sums with one rounding of the product, as the fused kernel's multiply-add does
            y = (y.double() * span.double() + (lo * self.w_rowsum).double()).float()
        else:
            y = torch.ops.quantized.linear_dynamic(xm, self.packed, self.reduce_range)
        if self.outliers_fp16 is not None:  # row by row the same sums, whatever is batched beside a row
            kept = x.index_select(1, self.outliers)  # [N, k]
            side = _fp16_matmul_in_whole_kernels(kept, self.outliers_fp16)
            y.add_(side, alpha=self.outliers_scale)  # a power of two: exact, fused or not
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def _fp16_matmul_in_whole_kernels(kept: torch.Tensor, packed: object) -> torch.Tensor:
    """[kept, kept] @ the packed fp16 pair (`_pack_fp32_as_fp16_pair`): [N, out] for `kept` [N, k], its rows padded
    with zero rows to a multiple of FP16_KERNEL_ROWS, so that fbgemm sums every row in a 6-row kernel (the module's
    docstring) and a row's result does not depend on how many rows came with it."""
    n, k = kept.shape
    rows = kept.new_zeros(-(-n // FP16_KERNEL_ROWS) * FP16_KERNEL_ROWS, 2 * k)
    rows[:n, :k] = kept
    rows[:n, k:] = kept
    return torch.ops.quantized.linear_dynamic_fp16(rows, packed)[:n]


def _pack_fp32_as_fp16_pair(w: torch.Tensor) -> tuple[object | None, float]:
    """fbgemm's packed fp16 weight [out, 2 k] for fp32 `w` [out, k] and the power of two to multiply its products
    by: w / scale = high + low, high its fp16 rounding, low the fp16 rounding of what is left (22-odd bits
    together); the input goes in twice, [x, x]. None for no columns."""
    if w.shape[1] == 0:
        return None, 1.0
    scale = 2.0 ** int(torch.frexp(w.abs().amax().clamp(min=1e-30)).exponent)  # |w / scale| < 1: fp16 holds it
    scaled = w / scale
    high = scaled.half().float()
    low = (scaled - high).half().float()
    return torch.ops.quantized.linear_prepack_fp16(torch.cat((high, low), dim=1).contiguous(), None), scale


class Fp16Linear(nn.Module):
    """fp16 weights, fp32 activations and accumulation (fbgemm): half the head's memory traffic."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features), self.packed)
        return y.reshape(*shape[:-1], self.out_features)


def calibration_chunks(model_dir: Path) -> list[torch.Tensor]:
    """Token chunks of ShareGPT first turns (the file's first 400; the benchmark measures on its tail)."""
    from transformers import AutoTokenizer

    from assets.datasets import sharegpt_first_turns

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("\n\n".join(sharegpt_first_turns(limit=400)), add_special_tokens=False)["input_ids"][:CALIBRATION_TOKENS]
    return [torch.tensor(ids[i:i + CHUNK]) for i in range(0, len(ids), CHUNK)]


@torch.inference_mode()
def prefill_logits(model: nn.Module, ids: torch.Tensor, block_size: int = 16,
                   kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every position's logits [n, vocab] for one token sequence [n], through a scratch paged cache (in the
    model's dtype, or `kv_dtype`)."""
    return model.compute_logits(prefill_hidden(model, ids, block_size, kv_dtype))


@torch.inference_mode()
def prefill_hidden(model: nn.Module, ids: torch.Tensor, block_size: int = 16,
                   kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every position's last hidden state [n, hidden] (before the final norm), as `prefill_logits` reads them."""
    cfg = model.config
    n = len(ids)
    blocks = -(-n // block_size)
    kv = torch.zeros(cfg.num_hidden_layers, 2, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                     dtype=kv_dtype or model.embed_tokens.weight.dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode_seqs=0, decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_mask=None, decode_context_len=0, decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefill_query_starts=[0], prefill_query_lens=[n], prefill_block_tables=[torch.arange(blocks)],
        prefill_context_lens=[n])
    return model(ids, torch.arange(n), kv, meta)


@torch.inference_mode()
def activation_ranges(model: nn.Module, chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |activation| every nn.Linear of our Llama sees over the chunks. The head's
    input (the final norm's output) is read without running the head: its [n, vocab] product was a fifth of the
    calibration's arithmetic, for a range no one needs but bench/int8_variants.py."""
    ranges: dict[str, torch.Tensor] = {}

    def seen(name: str, x: torch.Tensor) -> None:
        a = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        ranges[name] = a if name not in ranges else torch.maximum(ranges[name], a)

    def record(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
            seen(name, inputs[0])
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        for ids in chunks:
            seen("lm_head", model.norm(prefill_hidden(model, ids)))
    finally:
        for h in hooks:
            h.remove()
    return ranges


def _smoothing(act: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    w = torch.stack([x.abs().amax(dim=0) for x in weights]).amax(dim=0)
    return (act.clamp(min=1e-5) ** SMOOTH_ALPHA / w.clamp(min=1e-5) ** (1 - SMOOTH_ALPHA)).clamp(min=1e-5)


@torch.inference_mode()
def smooth_(model: nn.Module, ranges: dict[str, torch.Tensor]) -> None:
    """SmoothQuant, in place: the model computes the same function; `ranges` become the smoothed inputs' ranges."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        p = f"layers.{i}."
        s = _smoothing(ranges[p + "self_attn.qkv_proj"], [attn.qkv_proj.weight])
        layer.input_layernorm.weight.div_(s)
        attn.qkv_proj.weight.mul_(s)
        ranges[p + "self_attn.qkv_proj"] = ranges[p + "self_attn.qkv_proj"] / s
        s = _smoothing(ranges[p + "mlp.gate_up_proj"], [mlp.gate_up_proj.weight])
        layer.post_attention_layernorm.weight.div_(s)
        mlp.gate_up_proj.weight.mul_(s)
        ranges[p + "mlp.gate_up_proj"] = ranges[p + "mlp.gate_up_proj"] / s
        s = _smoothing(ranges[p + "mlp.down_proj"], [mlp.down_proj.weight])
        mlp.gate_up_proj.weight[mlp.intermediate_size:].div_(s[:, None])  # up_proj's rows: down's input channels
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias[mlp.intermediate_size:].div_(s)
        mlp.down_proj.weight.mul_(s)
        ranges[p + "mlp.down_proj"] = ranges[p + "mlp.down_proj"] / s


@torch.inference_mode()
def quantize_int8_dynamic_(model: nn.Module, chunks: list[torch.Tensor], model_dir: Path | None = None) -> int:
    """Calibrate on `chunks` (the ranges kept in `model_dir` when it has them for these inputs: engine/int8_ranges.py),
    smooth, then swap every decoder projection for Int8DynamicLinear and the head for Fp16Linear, in place; returns
    how many int8 projections there are."""
    ranges = activation_ranges(model, chunks) if model_dir is None else \
        cached_ranges(model_dir, chunks, lambda: activation_ranges(model, chunks))
    smooth_(model, ranges)
    model.lm_head = Fp16Linear(model.lm_head)  # the embeddings stay fp32 (a tied head is unaffected)
    count = 0
    for i, layer in enumerate(model.layers):
        for parent, prefix in ((layer.self_attn, "self_attn."), (layer.mlp, "mlp.")):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    k = min(OUTLIERS.get(name, DEFAULT_OUTLIERS), child.in_features // 4)
                    outliers = torch.topk(ranges[f"layers.{i}.{prefix}{name}"], k).indices.sort().values
                    setattr(parent, name, Int8DynamicLinear(child.weight, child.bias, outliers))
                    count += 1
    return count
