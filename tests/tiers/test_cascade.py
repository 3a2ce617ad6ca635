"""The cascade's cheap check and its choice of the next tier."""

from __future__ import annotations

from tiers.cascade import Verdict, check_answer, next_dearer, sum_logprobs
from tiers.catalogue import TierCatalogue


def _tier(price: str, context: int) -> dict[str, object]:
    return {"backend": "openai", "model": "m", "urls": ["http://x"], "price_per_1k_input": price,
            "price_per_1k_output": price, "hardware_cost_per_hour": "1", "context_limit": context}


CAT = TierCatalogue(tiers={"small": _tier("0.1", 4096), "mid": _tier("0.2", 4096), "full": _tier("0.3", 4096),
                           "long": _tier("0.4", 32768)})


def check(text: str = "an answer", finish: str = "stop", by_context: bool = False, mean: float | None = None,
          threshold: float | None = None) -> str | None:
    v = check_answer(text, finish_reason=finish, cap_by_context=by_context, mean_logprob=mean,
                     min_mean_logprob=threshold)
    return None if v is None else v.code


def test_what_fails_the_check() -> None:
    assert check() is None
    assert check("  \n") == "empty"
    assert check(finish="length", by_context=True) == "truncated"
    assert check(finish="length") is None  # the client's own max_tokens: what it asked for
    assert check(mean=-2.5, threshold=-1.5) == "low_logprob"
    assert check(mean=-1.0, threshold=-1.5) is None
    assert check(mean=None, threshold=-1.5) is None  # no logprobs from the upstream: not judged on them


def test_the_next_tier_is_the_cheapest_dearer_one_allowed_and_up() -> None:
    empty = Verdict("empty", "empty answer")
    small, mid = CAT.tiers["small"], CAT.tiers["mid"]
    assert next_dearer(CAT, small, ["small", "mid", "full"], [], empty).name == "mid"  # type: ignore[union-attr]
    assert next_dearer(CAT, small, ["small", "mid", "full"], ["mid"], empty).name == "full"  # type: ignore[union-attr]
    assert next_dearer(CAT, small, ["small", "mid"], ["mid"], empty) is None
    assert next_dearer(CAT, CAT.tiers["full"], ["small", "mid", "full"], [], empty) is None
    # a truncated answer needs more context: the same context would cut it again
    truncated = Verdict("truncated", "")
    assert next_dearer(CAT, mid, ["small", "mid", "full"], [], truncated) is None
    assert next_dearer(CAT, mid, ["small", "mid", "full", "long"], [], truncated).name == "long"  # type: ignore[union-attr]


def test_logprobs_are_summed_from_openai_chunks() -> None:
    chunks = [{"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]}, None,
              {"content": [{"token": "c", "logprob": -1}]}]
    assert sum_logprobs(chunks) == (-3.0, 3)
