from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.sampler import nucleus_by_sort
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from wire.chat_request import MIN_TEMPERATURE


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    s = Sampler()
    assert s.sample("a", logits, SamplingParams(temperature=0)) == 1
    assert s.sample("b", logits, SamplingParams(temperature=1.0, top_k=1)) == 1
    assert s.sample("c", logits, SamplingParams(temperature=1.0, top_p=0.01)) == 1


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
@pytest.mark.parametrize("size", [6, 50_000])  # the first look at the likeliest tokens, and the whole vocabulary
def test_a_top_p_below_float32s_smallest_keeps_the_likeliest_token(top_p: float, size: int) -> None:
    """It passes `> 0`, and rounded to 0 in float32 it dropped every token: the draw failed (a 500 from the engine)."""
    logits = torch.zeros(size)
    logits[3] = 1.0
    assert Sampler().sample("t", logits, SamplingParams(temperature=1.0, top_p=top_p, seed=1)) == 3


def test_seeded_sampling_repeats_and_unseeded_varies() -> None:
    logits = torch.zeros(50)

    def draw(seed: int | None, rid: str) -> list[int]:
        s = Sampler()
        return [s.sample(rid, logits, SamplingParams(temperature=1.0, seed=seed)) for _ in range(20)]

    assert draw(7, "x") == draw(7, "y")
    assert draw(7, "x") != draw(8, "x")


def test_top_k_and_top_p_never_sample_outside_their_set() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0, 0.0])
    s = Sampler()
    ks = {s.sample("k", logits, SamplingParams(temperature=2.0, top_k=2, seed=1)) for _ in range(200)}
    assert ks == {0, 1}
    ps = {s.sample("p", logits, SamplingParams(temperature=1.0, top_p=0.9, seed=2)) for _ in range(200)}
    assert ps <= {0, 1}


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1])
def test_any_seed_in_range_samples_and_repeats(seed: int) -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, seed=seed)
    first = [Sampler().sample("a", logits, params) for _ in range(3)]
    assert len(set(first)) == 1 and 0 <= first[0] < 100


@pytest.mark.parametrize(("seed", "other"), [(0, 2**32), (0, 2**63), (1, 2**32 + 1), (2**32 - 1, 2**64 - 1)])
def test_seeds_that_differ_only_above_32_bits_sample_differently(seed: int, other: int) -> None:
    """torch's CPU generator seeds from a seed's low 32 bits: seed 2^63 answered exactly as seed 0 (on SmolLM2, through
    the engine's server, the same text), so two requests asking for different seeds got the same sample."""
    logits = torch.zeros(1000)  # flat: 40 draws of two generators agree by chance with probability 1000^-40

    def draws(s: int) -> list[int]:
        sampler = Sampler()
        return [sampler.sample("r", logits, SamplingParams(temperature=1.0, seed=s)) for _ in range(40)]

    assert draws(seed) == draws(seed)  # each still repeats
    assert draws(seed) != draws(other)


def test_sampling_is_overflow_safe_even_below_the_checked_temperature() -> None:
    # SamplingParams refuses such a temperature; the sampler must not depend on it: divided unshifted,
    # 5 / 1e-40 is inf in float32 and softmax turns inf - inf into NaN
    logits = torch.tensor([5.0, 4.0, -3.0, 0.0])
    for temperature in (1e-40, MIN_TEMPERATURE, 2.0):
        params = SamplingParams(temperature=1.0, seed=0)
        params.temperature = temperature
        picks = {Sampler().sample("t", logits, params) for _ in range(5)}
        assert picks == {0} if temperature < 1 else picks <= {0, 1, 2, 3}


@pytest.mark.parametrize("spread", [0.05, 1.0, 4.0, 12.0])  # 0.05: nearly flat, so top-p needs most of the vocabulary
@pytest.mark.parametrize("top_p", [0.01, 0.5, 0.9, 0.95, 0.999])
def test_top_p_keeps_what_sorting_the_whole_vocabulary_keeps(spread: float, top_p: float) -> None:
    gen = torch.Generator().manual_seed(int(spread * 100) + int(top_p * 1000))
    for size in (5, 300, 49152):
        for _ in range(3):
            logits = torch.randn(size, generator=gen) * spread
            for params in (SamplingParams(temperature=0.8, top_p=top_p),
                           SamplingParams(temperature=1.3, top_p=top_p, top_k=min(size, 1000))):
                got = Sampler.distribution(logits, params)
                no_top_p = Sampler.distribution(logits, SamplingParams(temperature=params.temperature,
                                                                       top_k=params.top_k))
                expected = nucleus_by_sort(no_top_p, top_p)
                assert torch.equal(got, expected)
                assert float(got[got > 0].sum()) >= min(top_p, float(no_top_p.sum())) - 1e-5


def test_draws_follow_the_probabilities_and_never_pick_a_zero() -> None:
    probs = torch.zeros(1000)
    probs[[3, 10, 500, 998]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = np.random.Generator(np.random.PCG64(5))  # a seeded request's (Sampler.generator)
    n = 20000
    counts = torch.bincount(torch.tensor([Sampler.draw(probs, gen) for _ in range(n)]), minlength=1000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {3, 10, 500, 998}
    expected = probs[[3, 10, 500, 998]] * n
    chi2 = float(((counts[[3, 10, 500, 998]] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_a_draw_rounded_up_to_the_total_takes_the_last_token_with_a_probability(
        monkeypatch: pytest.MonkeyPatch) -> None:
    probs = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert Sampler.draw(probs, None) == 2
