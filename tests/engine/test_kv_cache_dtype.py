"""A bf16 KV cache under an fp32 model: half the bytes per token, K/V rounded to bf16, results close to fp32's.
(Its agreement with fp32 on SmolLM2 and its speed are measured by bench/engine.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.int8_dynamic import prefill_logits
from engine.model_runner import ModelRunner
from tests.engine.driver import generate_greedy

BUDGET = 1 << 20


def test_a_bf16_cache_holds_twice_the_tokens_of_an_fp32_one(tiny_llama: Path) -> None:
    fp32 = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=BUDGET)
    bf16 = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=BUDGET, kv_cache_dtype="bf16")
    assert fp32.kv_cache.dtype == torch.float32 and bf16.kv_cache.dtype == torch.bfloat16
    assert bf16.num_kv_blocks == 2 * fp32.num_kv_blocks
    assert bf16.kv_cache.numel() * 2 <= BUDGET
    assert ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=BUDGET, kv_cache_dtype="auto").kv_dtype == torch.float32


@pytest.mark.parametrize("kv", ["fp16", "int4"])
def test_other_cache_dtypes_are_refused(tiny_llama: Path, kv: str) -> None:
    with pytest.raises(ValueError, match="KV cache dtype"):
        ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=BUDGET, kv_cache_dtype=kv)


def test_logits_through_a_bf16_cache_are_close_but_not_equal(tiny_llama: Path) -> None:
    model = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=BUDGET).model
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(0))
    exact = prefill_logits(model, ids)
    rounded = prefill_logits(model, ids, kv_dtype=torch.bfloat16)
    error = float((rounded - exact).norm() / exact.norm())
    assert 0 < error < 1e-2  # rounded K/V (not exact), and only by bf16's precision


def test_greedy_decoding_on_a_bf16_cache_follows_the_fp32_one(tiny_llama: Path) -> None:
    prompts = [[1, 5, 9, 200][: n] * 5 for n in (1, 2, 3, 4)]
    outputs = {kv: generate_greedy(ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=BUDGET, kv_cache_dtype=kv),
                                   prompts, 12, arrivals=[0, 1, 2, 5])[0] for kv in ("auto", "bf16")}
    same = sum(a == b for exact, rounded in zip(outputs["auto"], outputs["bf16"], strict=True)
               for a, b in zip(exact, rounded, strict=True))
    assert same >= 0.9 * 48  # rounding may flip a near-tie; a broken bf16 decode path would agree by chance only


def test_a_bf16_cache_is_part_of_the_model_version(tiny_llama: Path) -> None:
    from engine.launch import model_version

    plain = model_version(tiny_llama, dtype="float32", quantize=None)
    assert model_version(tiny_llama, dtype="float32", quantize=None, kv_cache_dtype="auto") == plain
    assert model_version(tiny_llama, dtype="float32", quantize=None, kv_cache_dtype="bf16") != plain
