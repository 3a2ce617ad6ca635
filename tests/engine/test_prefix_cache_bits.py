"""A prompt's answer after a prefix-cache hit is bit for bit the answer of the same prompt prefilled whole.

On SmolLM2 (fp32, and the int8 tier where fbgemm runs it), through the native kernels and the torch ops: for
prompt lengths around block and SDPA query-block edges and every cached length a hit can have (multiples of the
16-token block), the first token's log-probabilities (its top 20, exact floats) and the next greedy steps' are the
same as the whole prompt's. The cached blocks come from another, shorter prompt (as they do in use), and a
remainder of one token runs as a decode. A chunked prefill (a small step budget) is held to the same bits. Before
every CPU row was attended as a decode (engine/model_runner.py), SDPA's fused kernel summed a chunk's rows
otherwise than the whole prompt's, a few ulps apart: the same greedy request sent twice could get two answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import int8_dynamic
from engine.block_manager import BlockManager
from engine.kernels import native
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

pytestmark = pytest.mark.model

# one, two and four past a block; past SDPA's 32- and 64-row blocks; a long prompt. 16 (prompt, cached) pairs: 35
# (with 19, 35, 48, 97 and six cached lengths a prompt) took 137 s on the torch ops' int8 tier beside another test
# worker, every prompt row attended alone there; what decides a row's bits in a linear layer is held to its batch
# size by tests/engine/test_int8_dynamic.py
LENGTHS = [17, 18, 20, 33, 49, 65, 200]
MAX_HITS = 4  # cached lengths tried per prompt: the shortest and the longest
STEPS = 4  # greedy tokens compared after the prompt (each with its top-20 log-probabilities)


class Asker:
    """One runner with one scheduler and block manager, so requests share the prefix cache, asked one at a time."""

    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int = 4096) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=runner.max_model_len, eos_token_ids=set())
        self.num_asked = 0

    def ask(self, prompt: list[int], max_tokens: int = STEPS) -> tuple[int, list[tuple[int, tuple]]]:
        """(prompt tokens found in the prefix cache, each made token with its log-probabilities)."""
        self.num_asked += 1
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=20)
        seq = Sequence(f"r{self.num_asked}", prompt, params)
        self.scheduler.add_request(seq)
        made = []
        while self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            tokens = self.runner.run(out)
            if out.do_sample[0]:  # its prompt's last chunk, or a decode: the one sequence asked samples
                made.append((tokens[0], self.runner.last_logprobs[seq.request_id]))
            self.scheduler.postprocess(out, tokens)
        return seq.num_cached_tokens, made


@pytest.fixture(scope="module", params=["native", "torch"])
def kernels(request: pytest.FixtureRequest) -> str:
    return request.param


def _runner(model_dir: Path, kernels: str, quantize: str | None, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    if kernels == "native" and native.load() is None:
        pytest.skip("no C++ toolchain: the torch ops are the only path")
    if kernels == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
    return ModelRunner(model_dir, dtype="fp32", quantize=quantize, kv_cache_bytes=32 << 20)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_prefix_cache_hit_of_any_length_gives_the_whole_prompts_bits(
        prepared_models: Path, kernels: str, quantize: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if quantize == "int8" and not int8_dynamic.available(torch.device("cpu"), torch.float32):
        pytest.skip("no fbgemm: the int8 tier is weight-only here")
    asker = Asker(_runner(prepared_models / "smollm2-135m-instruct", kernels, quantize, monkeypatch))
    bm = asker.block_manager
    g = torch.Generator().manual_seed(0)
    text = [1, *torch.randint(2, asker.runner.config.vocab_size, (max(LENGTHS),), generator=g).tolist()]
    differ = []
    for length in LENGTHS:
        prompt = text[:length]
        bm.reset_prefix_cache()
        num_cached, whole = asker.ask(prompt)
        assert num_cached == 0
        hits = list(range(bm.block_size, length, bm.block_size))
        for cached in hits[:MAX_HITS // 2] + hits[MAX_HITS // 2:][-MAX_HITS // 2:]:
            bm.reset_prefix_cache()
            asker.ask([*prompt[:cached], 7], max_tokens=1)  # another prompt, whose first blocks this one shares
            num_cached, hit = asker.ask(prompt)
            assert num_cached == cached
            if hit != whole:
                differ.append((length, cached))
    assert not differ, f"(prompt length, cached length) whose answer differs from the whole prompt's: {differ}"


def test_a_chunked_prefill_gives_the_whole_prompts_bits(prepared_models: Path, kernels: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(prepared_models / "smollm2-135m-instruct", kernels, None, monkeypatch)
    g = torch.Generator().manual_seed(1)
    prompt = [1, *torch.randint(2, runner.config.vocab_size, (199,), generator=g).tolist()]
    whole = Asker(runner).ask(prompt)
    for budget in (48, 64, 99):  # chunks of the step budget, the last one shorter
        chunked = Asker(runner, max_num_batched_tokens=budget)
        assert chunked.ask(prompt) == whole, budget
