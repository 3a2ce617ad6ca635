"""The only torch code of the engine's request path: load a causal LM and run one forward at a time.

This is the correct-but-simple runner: one sequence per forward, a Hugging Face cache per sequence.
The engine calls only `prefill`, `decode` and `free`, so a paged, batched runner can replace it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.quantize import quantize_int8_
from engine.sequence import Sequence

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True where the CPU has AVX-512 BF16 or AMX, the instructions that make bf16 matmuls fast."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto` is bf16 on CUDA and on CPUs with fast bf16, fp32 elsewhere."""
    if name == "auto":
        if device.startswith("cuda") or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError as exc:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}") from exc


class ModelRunner:
    def __init__(self, model_dir: Path, *, dtype: str = "auto", device: str = "cpu",
                 quantize: str | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=self.dtype)
        if quantize == "int8":
            quantize_int8_(model)
        elif quantize is not None:
            raise ValueError(f"unknown quantization {quantize!r}; expected int8")
        self.model = model.to(self.device).eval()
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
        self.eos_token_ids = _eos_ids(model)

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Run the prompt; keep its cache on the sequence; return next-token logits [V] (fp32)."""
        from transformers import DynamicCache

        ids = torch.tensor([seq.prompt_token_ids], device=self.device)  # [1, T]
        seq.kv_state = DynamicCache()
        out = self.model(input_ids=ids, past_key_values=seq.kv_state, use_cache=True)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, seq: Sequence) -> torch.Tensor:
        """Feed the last sampled token; return the next-token logits [V] (fp32)."""
        ids = torch.tensor([[seq.last_token_id]], device=self.device)  # [1, 1]
        out = self.model(input_ids=ids, past_key_values=seq.kv_state, use_cache=True)
        return out.logits[0, -1].float()

    def free(self, seq: Sequence) -> None:
        seq.kv_state = None


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids
