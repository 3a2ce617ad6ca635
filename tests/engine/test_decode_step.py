"""The whole decode step in one native call (engine/decode_step.py) against the model's Python forward: the
same hidden states and the same K/V written, bit for bit; used only where it applies. (The greedy equality
tests against transformers also go through it: their decode steps take this path.)"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import int8_dynamic
from engine.block_manager import BlockManager
from engine.decode_step import NativeDecodeStep
from engine.kernels import native
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

GUARD_S = 10.0  # a bound on waiting for what must happen, never reached when it works: a failure, not a hang

pytestmark = pytest.mark.skipif(native.load() is None or not torch.backends.mkldnn.is_available(),
                                reason="no C++ toolchain or no oneDNN: the Python forward is the only path")


def decode_batch(runner: ModelRunner, prompt_lens: list[int]) -> tuple[list[Sequence], list[int]]:
    """Sequences of these prompt lengths, prefilled and past one decode, ready for a decode-only step."""
    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=16,
                      max_num_batched_tokens=256, max_model_len=runner.max_model_len, eos_token_ids=set())
    gen = torch.Generator().manual_seed(len(prompt_lens))
    for i, n in enumerate(prompt_lens):
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        sched.add_request(Sequence(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    while True:
        out = sched.schedule()
        if all(n == 1 for n in out.num_scheduled_tokens) and len(out.seqs) == len(prompt_lens):
            return out.seqs, out.num_scheduled_tokens
        sched.postprocess(out, runner.run(out))


@pytest.fixture
def int8_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration text for the int8 tier without a tokenizer (the tiny model has none)."""
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(int8_dynamic, "calibration_chunks", lambda _dir: [torch.randint(0, 256, (64,), generator=gen)])


BF16_ONEDNN = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize(("dtype", "quantize", "kv_cache_dtype"), [
    ("fp32", None, "auto"), ("fp32", None, "bf16"), ("fp32", "int8", "auto"),
    pytest.param("bf16", None, "auto", marks=pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN runs no bf16 here")),
])
@pytest.mark.parametrize("prompt_lens", [[5], [3, 40, 17, 33, 1]])
def test_the_native_step_equals_the_python_layers(tiny_llama: Path, int8_calibration: None, prompt_lens: list[int],
                                                  dtype: str, quantize: str | None, kv_cache_dtype: str) -> None:
    runner = ModelRunner(tiny_llama, dtype=dtype, quantize=quantize, kv_cache_bytes=1 << 20,
                         kv_cache_dtype=kv_cache_dtype)
    assert isinstance(runner.native_decode, NativeDecodeStep)
    seqs, counts = decode_batch(runner, prompt_lens)
    input_ids, positions, meta, _ = runner._prepare(seqs, counts)
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        native_hidden = runner.native_decode(input_ids, positions, runner.kv_cache, meta)
        native_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        python_hidden = runner.model(input_ids, positions, runner.kv_cache, meta)
    assert native_hidden.shape == (len(prompt_lens), 64)
    assert torch.equal(native_hidden, python_hidden)
    assert torch.equal(native_cache, runner.kv_cache)  # the new tokens' K/V, written to the same slots
    assert not torch.equal(native_cache, before)


def test_the_runner_takes_it_for_decode_only_steps(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20)
    calls = []
    step = runner.native_decode
    monkeypatch.setattr(runner, "native_decode", lambda *a: calls.append(len(a[0])) or step(*a))
    sched = Scheduler(BlockManager(runner.num_kv_blocks, runner.block_size), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=runner.max_model_len, eos_token_ids=set())
    sched.add_request(Sequence("a", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    out = sched.schedule()
    sched.postprocess(out, runner.run(out))  # the prompt: the Python forward
    assert calls == []
    sched.add_request(Sequence("b", list(range(1, 9)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    out = sched.schedule()  # a's decode with b's prompt: the Python forward
    sched.postprocess(out, runner.run(out))
    assert calls == []
    out = sched.schedule()  # two decodes
    sched.postprocess(out, runner.run(out))
    assert calls == [2]


@pytest.mark.parametrize("kind", ["bf16 without oneDNN", "nn.Linear", "int8 without fused rows"])
def test_other_models_keep_the_python_forward(tiny_llama: Path, int8_calibration: None,
                                              monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind in ("nn.Linear", "bf16 without oneDNN"):  # bf16 then runs wholly in bf16, activations too
        monkeypatch.setenv("TIERGATE_ONEDNN", "0")
    runner = ModelRunner(tiny_llama, dtype="bf16" if kind.startswith("bf16") else "fp32",
                         quantize="int8" if kind.startswith("int8") else None, kv_cache_bytes=1 << 20)
    if kind.startswith("int8"):
        assert runner.native_decode is not None
        runner.model.layers[1].mlp.down_proj.kernels = None  # one layer on the torch ops: not callable natively
        assert NativeDecodeStep.of(runner.model, runner.decode_kernel) is None
    else:
        assert runner.native_decode is None
        if kind.startswith("bf16"):
            assert runner.activation_dtype == runner.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN runs no bf16 on this CPU")
def test_bf16_on_cpu_is_bf16_matmuls_around_fp32_activations(tiny_llama: Path) -> None:
    runner = ModelRunner(tiny_llama, dtype="bf16", kv_cache_bytes=1 << 20)
    assert runner.dtype == torch.bfloat16 and runner.activation_dtype == torch.float32
    assert runner.kv_cache.dtype == torch.bfloat16  # the cache a bf16 model had: the same tokens per byte
    assert isinstance(runner.native_decode, NativeDecodeStep)
    head = runner.model.lm_head
    assert head.weight_dtype == torch.bfloat16 and head.packed.dtype == torch.bfloat16
    with torch.inference_mode():
        hidden = torch.randn(3, 64)
        logits = head(hidden)
        assert logits.dtype == torch.float32
        weight = runner.model.embed_tokens.weight  # tied: the head's weight before packing
        expected = (hidden.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().t()).to(torch.bfloat16)
        torch.testing.assert_close(logits, expected.float(), rtol=1e-2, atol=1e-2)


def test_a_layer_missing_its_linears_is_refused() -> None:
    layers = native.load().DecodeLayers(eps=1e-5, heads=1, kv_heads=1, dim=8, scale=1.0)
    layers.add_layer(torch.ones(8), torch.ones(8))
    with pytest.raises(RuntimeError, match="four linear layers"):
        layers.add_layer(torch.ones(8), torch.ones(8))
    with pytest.raises(RuntimeError, match="four linear layers"):
        one = torch.ones(1, dtype=torch.long)
        layers.run(torch.zeros(1, 8), torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(1, 2, 1, 16, 1, 8), one - 1,
                   torch.zeros(1, 1, dtype=torch.long), one)


def test_other_python_threads_run_during_a_step(tiny_llama: Path) -> None:
    """A step holds no GIL: the server's event loop keeps serving while the engine thread computes. With a switch
    interval longer than the test, a thread that waits for the GIL gets it only when its holder lets it go: the main
    thread sets `ran` while the worker runs steps only if a step lets it go; holding it, every step the worker runs
    until its guard (GUARD_S) gives up would end before the main thread ran at all."""
    runner = ModelRunner(tiny_llama, dtype="fp32", kv_cache_bytes=1 << 20)
    rows = 8192  # the tiny model's 2 layers' qkv, o, gate_up and down, on many rows: one call of some length
    inputs = [torch.randn(rows, 64), torch.randn(rows, 64), torch.randn(rows, 64), torch.randn(rows, 128)] * 2
    ran = threading.Event()
    steps_until_ran: list[int | None] = []

    def steps() -> None:
        deadline, n = time.monotonic() + GUARD_S, 0
        while not ran.is_set() and time.monotonic() < deadline:
            runner.native_decode.layers.run_linears(inputs)
            n += 1
        steps_until_ran.append(n if ran.is_set() else None)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10 * GUARD_S)
    try:
        worker = threading.Thread(target=steps)
        worker.start()  # returns once the worker lets the GIL go
        ran.set()
        worker.join(2 * GUARD_S)
    finally:
        sys.setswitchinterval(interval)
    assert not worker.is_alive()
    assert steps_until_ran != [None], "the main thread ran only after the steps: a step held the GIL"
    assert steps_until_ran[0] >= 1, "the main thread ran before any step: nothing was tested"
