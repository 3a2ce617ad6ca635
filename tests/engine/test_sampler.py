from __future__ import annotations

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    s = Sampler()
    assert s.sample("a", logits, SamplingParams(temperature=0)) == 1
    assert s.sample("b", logits, SamplingParams(temperature=1.0, top_k=1)) == 1
    assert s.sample("c", logits, SamplingParams(temperature=1.0, top_p=0.01)) == 1


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
