"""The cascade's checks (cheap and calibrated), the engine signals the calibrated one reads, and its choice of
the next tier."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from tiers.cascade import (
    ALTERNATIVES_FEATURES,
    SIGNAL_FEATURES,
    AnswerSignals,
    Verdict,
    check_answer,
    check_confidence,
    entropy_estimate,
    next_dearer,
    outcome_values,
    signals_of,
    sum_logprobs,
    values_of,
)
from tiers.catalogue import TierCatalogue
from tiers.difficulty import FLOOR_GRID, CascadeCalibration, ConfidenceHead, PairThresholds, RidgeHead


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


# ---- the engine's signals and the calibrated check ----

def test_entropy_estimate_orders_sure_and_unsure_distributions() -> None:
    sure = entropy_estimate([math.log(0.97), math.log(0.01), math.log(0.01)])
    unsure = entropy_estimate([math.log(0.3), math.log(0.3), math.log(0.3)])
    assert 0.0 < sure < unsure
    assert entropy_estimate([0.0]) == pytest.approx(0.0)  # one certain token
    # the rest of the mass counts as one more outcome: a lower bound on the true entropy (log 4 for 4 equal)
    assert entropy_estimate([math.log(0.25)] * 2) == pytest.approx(-(0.5 * math.log(0.25) + 0.5 * math.log(0.5)))
    assert entropy_estimate([math.log(0.25)] * 2) < math.log(4)


def test_answer_signals_from_tokens_and_from_openai_chunks() -> None:
    tokens = [(-0.1, [-0.1, -3.0, -4.0]), (-1.2, [-1.0, -1.2, -2.0]), (-0.05, [-0.05, -4.0])]
    s = signals_of(tokens)
    f = dict(zip(SIGNAL_FEATURES, s.features(stopped=True), strict=True))
    assert f["mean_logprob"] == pytest.approx(-1.35 / 3) and f["min_logprob"] == -1.2
    assert f["low_prob_frac"] == pytest.approx(1 / 3)  # -1.2 < log(0.5)
    assert f["min_margin"] == pytest.approx(0.2) and f["low_margin_frac"] == pytest.approx(1 / 3)
    assert f["log_tokens"] == pytest.approx(math.log(4)) and f["stopped"] == 1.0
    assert s.has_alternatives and s.mean_logprob == pytest.approx(-0.45)
    # the same tokens as our engine's server sends them, with junk a hostile upstream might add
    chunks = [{"content": [{"token": "a", "logprob": -0.1, "top_logprobs": [{"logprob": -0.1}, {"logprob": -3.0},
                                                                             {"logprob": -4.0}]},
                           {"token": "b", "logprob": -1.2, "top_logprobs": [{"logprob": -1.0}, {"logprob": -1.2},
                                                                             {"logprob": "x"}, {"logprob": -2.0}]}]},
              None, {"content": "nonsense"}, {"content": [{"token": "c"}, "junk",
                                                          {"logprob": -0.05, "top_logprobs": [{"logprob": -4.0},
                                                                                              {"logprob": -0.05}]}]}]
    from_chunks = AnswerSignals()
    for chunk in chunks:
        from_chunks.add_openai(chunk)
    assert from_chunks.features(stopped=True) == pytest.approx(s.features(stopped=True))


def test_signals_without_alternatives_and_impossible_tokens() -> None:
    s = signals_of([(-0.5, []), (float("-inf"), [])])
    assert not s.has_alternatives and s.num_tokens == 2
    f = dict(zip(SIGNAL_FEATURES, s.features(stopped=False), strict=True))
    assert f["min_logprob"] == -100.0 and f["mean_entropy"] == 0.0 and f["stopped"] == 0.0
    assert all(math.isfinite(v) for v in f.values())


def test_values_leave_out_what_needs_alternatives_when_a_token_came_without() -> None:
    sure = values_of(signals_of([(-0.1, [-0.1, -3.0]), (-0.2, [-0.2, -2.0])]), stopped=True)
    assert sure is not None and set(sure) == set(SIGNAL_FEATURES)
    bare = values_of(signals_of([(-0.1, [-0.1, -3.0]), (-0.2, [])]), stopped=True)
    assert bare is not None and set(bare) == set(SIGNAL_FEATURES) - ALTERNATIVES_FEATURES
    assert values_of(AnswerSignals(), stopped=True) is None
    # a head that reads entropy cannot score such an answer: "not checked", never a made-up 0
    ridge = RidgeHead(np.zeros(1), np.ones(1), np.ones(1), 0.0, 1.0, 0.1, 0.2, 100, 0.5, True)
    head = ConfidenceHead(["mean_entropy"], ridge, np.array([0.0, 1.0]), np.array([0.0, 1.0]))
    assert head.score(bare) is None and head.score(sure) is not None


def test_signals_of_openai_chunks_stop_at_a_limit() -> None:
    chunk = {"content": [{"logprob": -0.1, "top_logprobs": [{"logprob": -0.1}, {"logprob": -3.0}]}] * 5}
    first = AnswerSignals()
    first.add_openai(chunk, limit=3)
    first.add_openai(chunk, limit=3)
    assert first.num_tokens == 3 and first.has_alternatives


def calibration(threshold_at_floor: float) -> CascadeCalibration:
    """A confidence that is the mean log-probability mapped linearly onto [0, 1] over [-2, 0]; small -> mid keeps
    an answer at any floor once its score reaches `threshold_at_floor`."""
    ridge = RidgeHead(np.zeros(1), np.ones(1), np.ones(1), 0.0, 1.0, 0.1, 0.2, 100, 0.5, True)
    head = ConfidenceHead(["mean_logprob"], ridge, np.array([-2.0, 0.0]), np.array([0.0, 1.0]))
    pair = PairThresholds("small", "mid", 0.9, [threshold_at_floor] * len(FLOOR_GRID))
    return CascadeCalibration(5, {"small": head}, {"small->mid": pair})


def test_the_calibrated_check_keeps_or_retries_and_says_why() -> None:
    cal = calibration(-0.4)
    verdict, note = check_confidence({"mean_logprob": -0.6}, calibration=cal, cheap="small", strong="mid", floor=0.8)
    assert verdict is not None and verdict.code == "low_confidence" and note is None
    assert verdict.why == "calibrated confidence 0.70 < 0.80 needed for floor 0.8"
    verdict, note = check_confidence({"mean_logprob": -0.2}, calibration=cal, cheap="small", strong="mid", floor=0.8)
    assert verdict is None and note == "calibrated confidence 0.90 keeps floor 0.8"
    # a floor above what a retry can promise asks only for that (mid's 0.9 here)
    verdict, _ = check_confidence({"mean_logprob": -2.0}, calibration=calibration(-0.1), cheap="small",
                                  strong="mid", floor=0.95)
    assert verdict is not None and "< 0.90 needed for floor 0.95" in verdict.why
    # nothing to say for a pair it was not calibrated for, or without log-probabilities
    assert check_confidence({"mean_logprob": -2.0}, calibration=cal, cheap="small", strong="full",
                            floor=0.8) == (None, None)
    assert check_confidence(None, calibration=cal, cheap="small", strong="mid", floor=0.8) == (None, None)
    assert check_confidence({"mean_logprob": -2.0}, calibration=None, cheap="small", strong="mid",
                            floor=0.8) == (None, None)
    verdict, note = check_confidence({"log_tokens": 2.0}, calibration=cal, cheap="small", strong="mid", floor=0.8)
    assert verdict is None and note is not None and "not checked" in note


def test_a_pair_that_no_answer_passes_always_retries() -> None:
    cal = calibration(-0.4)
    cal.pairs["small->mid"].thresholds = [None] * len(FLOOR_GRID)
    verdict, _ = check_confidence({"mean_logprob": 0.0}, calibration=cal, cheap="small", strong="mid", floor=0.5)
    assert verdict is not None and verdict.code == "low_confidence"


def test_outcome_values_use_what_the_meter_gathered() -> None:
    @dataclass
    class Outcome:
        finish_reason: str | None
        mean_logprob: float | None
        output_tokens: int
        signals: AnswerSignals | None = None

    assert outcome_values(Outcome("stop", None, 3)) is None
    assert outcome_values(Outcome("length", -0.5, 3)) == {"mean_logprob": -0.5, "log_tokens": math.log(4),
                                                         "stopped": 0.0}
    full = outcome_values(Outcome("stop", -0.5, 1, signals_of([(-0.5, [-0.5, -1.0])])))
    assert full is not None and set(full) == set(SIGNAL_FEATURES) and full["stopped"] == 1.0
