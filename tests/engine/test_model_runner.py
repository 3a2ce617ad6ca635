"""Our Llama forward over the paged cache on a tiny random Llama: greedy output equals transformers'.

Alone, in a batch with staggered arrivals (chunked prefill, mixed prefill/decode steps), with prefix
reuse and under preemption. The only divergence allowed is at a near-tie in the reference (top two
logits within 1e-4), which is reported, not hidden.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import int8_dynamic
from engine.model_runner import ModelRunner, resolve_dtype
from engine.quantize import Int8Linear, quantize_int8_
from tests.engine.driver import assert_same_or_near_tie, generate_greedy

DEVICE = os.environ.get("TIERGATE_TEST_DEVICE", "cpu")  # bench/gpu_engine.sh runs these on cuda too


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_greedy(ref: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [[1, *torch.randint(2, 250, (length,), generator=g).tolist()] for length in lengths]


def test_greedy_alone_matches_transformers(tiny_llama: Path, reference: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22, device=DEVICE)
    for prompt in ([1, 5, 9, 200], [1, *range(10, 60)], *prompts(4, seed=1)):
        [ours], _ = generate_greedy(runner, [prompt], 12)
        assert_same_or_near_tie(reference, prompt, ours, hf_greedy(reference, prompt, 12))


def test_greedy_batch_of_16_with_staggered_arrivals_matches_transformers(tiny_llama: Path,
                                                                         reference: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22, device=DEVICE)
    batch = prompts(16, seed=2)
    batch[5] = [*batch[3][:40], 7, 7, 7]  # shares a prefix with an earlier request: reused from the cache
    outs, sched = generate_greedy(runner, batch, 10, arrivals=[i * 2 for i in range(16)], max_num_batched_tokens=48)
    assert sched.block_manager.num_prefix_hit_tokens >= 32
    for prompt, ours in zip(batch, outs, strict=True):
        assert_same_or_near_tie(reference, prompt, ours, hf_greedy(reference, prompt, 10))


def test_greedy_survives_preemption_and_recompute(tiny_llama: Path, reference: LlamaForCausalLM) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22, block_size=4)
    batch = prompts(6, seed=3)
    outs, sched = generate_greedy(runner, batch, 16, num_kv_blocks=60, max_num_batched_tokens=128)
    assert sched.num_preemptions_total > 0
    for prompt, ours in zip(batch, outs, strict=True):
        assert_same_or_near_tie(reference, prompt, ours, hf_greedy(reference, prompt, 16))


def test_int8_linear_is_close_and_the_model_still_agrees(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight-only int8 path (CUDA, and CPUs without fbgemm; x86 CPUs: tests/engine/test_int8_dynamic.py)."""
    monkeypatch.setattr(int8_dynamic, "available", lambda _device, _dtype: False)
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 96, bias=False)
    q = Int8Linear(lin)
    x = torch.randn(5, 64)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (96,)
    rel = (q(x) - lin(x)).norm() / lin(x).norm()
    assert rel < 0.01
    model = LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert quantize_int8_(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the head
    int8 = ModelRunner(tiny_llama, dtype="fp32", quantize="int8", kv_cache_bytes=1 << 22)
    full = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22)
    prompt = [1, *range(20, 40)]
    ([a], _), ([b], _) = generate_greedy(int8, [prompt], 8), generate_greedy(full, [prompt], 8)
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= 6


def test_the_kv_cache_is_sized_once_to_its_budget(tiny_llama: Path) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20, block_size=16)
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # k and v, 2 layers, 16 slots, 2 KV heads, head dim 16, fp32
    assert runner.num_kv_blocks == (1 << 20) // per_block
    assert runner.kv_cache.numel() * 4 <= 1 << 20
    assert runner.max_model_len == min(256, runner.num_kv_blocks * 16)
    with pytest.raises(ValueError, match="holds no block"):
        ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=100)


def test_dtype_resolution() -> None:
    assert resolve_dtype("fp32", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    # an int8 model on x86 keeps fp32 activations under auto (its fbgemm kernels take fp32): never the
    # weight-only bf16 fallback, whatever the CPU's bf16 instructions
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert resolve_dtype("auto", "cpu", "int8") == torch.float32
        assert resolve_dtype("auto", "cuda", "int8") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu", "int8") == torch.bfloat16  # a dtype named is kept
    with pytest.raises(ValueError):
        resolve_dtype("fp8", "cpu")


def test_the_near_tie_detector_reports_ties_and_fails_real_divergence() -> None:
    class Ref:
        def __init__(self, top: float, second: float) -> None:
            self.top, self.second = top, second

        def __call__(self, ids: torch.Tensor) -> object:
            logits = torch.zeros(1, ids.shape[1], 8)
            logits[0, -1, 3], logits[0, -1, 5] = self.top, self.second
            return type("Out", (), {"logits": logits})()

    with pytest.warns(UserWarning, match="near-tie divergence at output token 1"):
        assert_same_or_near_tie(Ref(2.0, 2.0 - 1e-5), [1], [3, 5], [3, 3])
    with pytest.raises(AssertionError, match="diverged at output token 1"):
        assert_same_or_near_tie(Ref(2.0, 1.0), [1], [3, 5], [3, 3])


def test_logprobs_are_the_models_own_log_softmax(tiny_llama: Path, reference: LlamaForCausalLM) -> None:
    from engine.block_manager import BlockManager
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 22)
    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=4,
                      max_num_batched_tokens=256, max_model_len=runner.max_model_len, eos_token_ids=set())
    prompt = prompts(1)[0]
    seq = Sequence("lp", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2))
    plain = Sequence("plain", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    sched.add_request(seq)
    sched.add_request(plain)
    got = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        made = runner.run(out)
        assert "plain" not in runner.last_logprobs  # only where asked: no cost for the others
        if "lp" in runner.last_logprobs:
            got.append(runner.last_logprobs["lp"])
        sched.postprocess(out, made)
    tokens = seq.output_token_ids
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    for i, (lp, top) in enumerate(got):
        row = logp[len(prompt) - 1 + i]
        assert abs(lp - float(row[tokens[i]])) < 1e-4
        assert [t for t, _ in top] == torch.topk(row, 2).indices.tolist() and top[0][0] == tokens[i]
