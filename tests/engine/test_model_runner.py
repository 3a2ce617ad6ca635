"""Our runner on a tiny random Llama: greedy output equals transformers' `generate`, fp32 and int8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.model_runner import ModelRunner, resolve_dtype
from engine.quantize import Int8Linear, quantize_int8_
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=255, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    seq = Sequence("t", prompt, SamplingParams(temperature=0, max_tokens=n))
    logits = runner.prefill(seq)
    for _ in range(n):
        seq.output_token_ids.append(int(torch.argmax(logits)))
        logits = runner.decode(seq)
    return seq.output_token_ids


def test_greedy_matches_transformers_generate(tiny_llama: Path) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32")
    ref = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt in ([1, 5, 9, 200], [1, *range(10, 60)]):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy(runner, prompt, 12) == expected


def test_int8_linear_is_close_and_the_model_still_agrees(tiny_llama: Path) -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 96, bias=False)
    q = Int8Linear(lin)
    x = torch.randn(5, 64)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (96,)
    rel = (q(x) - lin(x)).norm() / lin(x).norm()
    assert rel < 0.01
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert quantize_int8_(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the head
    runner = ModelRunner(tiny_llama, dtype="fp32", quantize="int8")
    full = ModelRunner(tiny_llama, dtype="fp32")
    prompt = [1, *range(20, 40)]
    a, b = greedy(runner, prompt, 8), greedy(full, prompt, 8)
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= 6


def test_dtype_resolution() -> None:
    assert resolve_dtype("fp32", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("fp8", "cpu")
