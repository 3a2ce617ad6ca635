"""The Llama family (Llama 2/3, SmolLM2, ...) as our own forward over a flat batch of tokens.

Every new token of a step, across all sequences, goes through the linear layers as one [N, hidden]
matrix; only attention looks at sequence boundaries (see engine/attention.py). q/k/v and gate/up are
fused into one matmul each. The numerics follow transformers' Llama (fp32 RMSNorm, rotate-half rope)
so greedy output matches it token for token in fp32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.layer_ops import TorchLayerOps


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_dir(cls, model_dir: Path) -> LlamaConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        if raw.get("model_type") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported architecture {raw.get('model_type')!r}; the engine runs the Llama family")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope scaling {rope!r}")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", raw.get("model_type") == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
        )


class RMSNorm(nn.Module):
    """Holds the weight; the layers apply it through their layer ops (fused with the residual add)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchLayerOps.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_tables()

    def reset_tables(self) -> None:
        """Fill the tables in fp32 on their device (also after the model was built on the meta device)."""
        device = self.cos.device
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N, D] for the step's positions [N], looked up once per step for every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata, ops: TorchLayerOps) -> torch.Tensor:
        n = x.shape[0]
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, KV, D] each
        # rotated q [N, H, D]; rotated K and V go to their cache slots first, so attention sees them
        q = ops.rope_write_kv(self.qkv_proj(x), *rope, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                              self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)  # [N, H, D]
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))  # gate_up: [N, 2 I]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The layer's four matmuls in the order they run: q/k/v, o, gate/up, down."""
        return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata, ops: TorchLayerOps
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, with residual None);
        returns this layer's MLP output and the running residual sum, which the next layer adds first."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = ops.add_rms_norm(residual, x, norm1.weight, norm1.eps)
        h, residual = ops.add_rms_norm(residual, self.self_attn(h, rope, kv_cache, meta, ops), norm2.weight, norm2.eps)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ops: TorchLayerOps = TorchLayerOps()  # the runner swaps in the fused native ops where they exist
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def empty(cls, cfg: LlamaConfig, dtype: torch.dtype) -> LlamaForCausalLM:
        """The model with uninitialized weights (no random init: every weight is loaded from files)."""
        with torch.device("meta"):
            model = cls(cfg).to(dtype)
        model = model.to_empty(device="cpu")
        model.tie_weights()
        model.rotary.reset_tables()
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [N]; kv_caches: [layers, 2, num_blocks, block_size, KV, D] -> hidden [N, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta, self.ops)
        return residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] (only the rows that sample) -> [S, vocab]
        return self.lm_head(self.norm(hidden))

    def load_weights(self, model_dir: Path) -> None:
        """Load HF-named safetensors, fusing q/k/v and gate/up as they arrive."""
        from safetensors import safe_open

        params = dict(self.named_parameters())
        missing = set(params)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        fused = {"q_proj": ("qkv_proj", 3), "k_proj": ("qkv_proj", 3), "v_proj": ("qkv_proj", 3),
                 "gate_proj": ("gate_up_proj", 2), "up_proj": ("gate_up_proj", 2)}
        order = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if "rotary_emb" in name:
                        continue
                    target = name.removeprefix("model.")
                    parts = target.split(".")
                    part = next((p for p in parts if p in fused), None)
                    if part is None:
                        if target == "lm_head.weight" and self.config.tie_word_embeddings:
                            target = "embed_tokens.weight"  # tied: some files keep only one of the two names
                        with torch.no_grad():
                            params[target].copy_(f.get_tensor(name))
                        missing.discard(target)
                        continue
                    dest, count = fused[part]
                    dest_name = target.replace(part, dest)
                    pending.setdefault(dest_name, {})[part] = f.get_tensor(name)
                    if len(pending[dest_name]) == count:
                        pieces = pending.pop(dest_name)
                        with torch.no_grad():
                            params[dest_name].copy_(torch.cat([pieces[p] for p in order[dest]], dim=0))
                        missing.discard(dest_name)
        if pending or missing:
            raise ValueError(f"incomplete weights in {model_dir}: {sorted(set(pending) | missing)}")
