"""The cascade's calibration on synthetic answers whose log-probabilities say how good they are: the score
ranks answers, the calibration is monotone and honest on answers it never saw, and the thresholds keep the
floor asked for."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tiers.difficulty import FLOOR_GRID
from training.confidence import (
    BASIC_FEATURES,
    calibrate_cascade,
    fit_confidence,
    signal_study,
    signal_values,
    threshold_for,
)
from training.tier_answers import Answer


def synthetic(n: int, seed: int, *, informative: bool = True) -> tuple[list[Answer], np.ndarray]:
    """Answers whose fidelity is a noisy function of how sure each token was (or of nothing)."""
    rng = np.random.default_rng(seed)
    answers, fidelity = [], []
    for _ in range(n):
        sureness = rng.uniform(0.05, 0.95)  # the chosen token's probability, roughly
        tokens = []
        for _ in range(int(rng.integers(4, 30))):
            p = float(np.clip(sureness + rng.normal(scale=0.05), 0.02, 0.99))
            rest = (1 - p) / 4
            tokens.append((math.log(p), sorted([math.log(p), *[math.log(rest)] * 4], reverse=True)))
        answers.append(Answer(10, "some text", list(range(len(tokens))), "stop", tokens))
        signal = sureness if informative else rng.uniform()
        fidelity.append(float(np.clip(0.2 + 0.8 * signal + rng.normal(scale=0.05), 0, 1)))
    return answers, np.array(fidelity)


def test_signal_values_skip_empty_answers_and_cut_a_look_ahead() -> None:
    assert signal_values(Answer(3, "  ", [2], "stop", [(-0.1, [-0.1, -3.0])])) is None
    assert signal_values(Answer(3, "text", [5], "stop", None)) is None
    long = Answer(3, "text", list(range(20)), "stop", [(-0.1, [-0.1, -3.0])] * 20)
    whole, first = signal_values(long), signal_values(long, first_tokens=8)
    assert whole is not None and first is not None
    assert whole["stopped"] == 1.0 and first["stopped"] == 0.0  # 8 tokens in, it had not stopped yet
    assert first["log_tokens"] == pytest.approx(math.log(9))


def test_the_confidence_ranks_answers_and_its_calibration_holds_on_unseen_ones() -> None:
    answers, fidelity = synthetic(400, seed=0)
    values = [signal_values(a) for a in answers]
    head, _ = fit_confidence(values, fidelity)  # type: ignore[arg-type]
    assert head.ridge.beats_mean and head.ridge.cv_rmse < 0.5 * head.ridge.baseline_rmse
    assert np.all(np.diff(head.iso_x) >= 0) and np.all(np.diff(head.iso_y) >= 0)
    # on fresh answers: those the threshold for a floor keeps are as good as the floor, on average
    fresh, fresh_fid = synthetic(2000, seed=1)
    scores = np.array([head.score(signal_values(a)) for a in fresh])  # type: ignore[arg-type]
    for floor in (0.5, 0.7, 0.8):
        t = threshold_for(head, floor)
        assert t is not None
        kept = scores >= t
        assert 0.05 < kept.mean() < 1.0 and fresh_fid[kept].mean() >= floor - 0.02
    assert threshold_for(head, 0.0) == -math.inf and threshold_for(head, 1.01) is None


def test_a_confidence_without_signal_does_not_beat_the_mean() -> None:
    answers, fidelity = synthetic(300, seed=2, informative=False)
    head, _ = fit_confidence([signal_values(a) for a in answers], fidelity)  # type: ignore[misc]
    assert not head.ridge.beats_mean


def test_pairs_thresholds_rise_with_the_floor_and_stop_at_what_a_retry_promises() -> None:
    small, small_fid = synthetic(300, seed=3)
    mid, mid_fid = synthetic(300, seed=4)
    cal = calibrate_cascade({"small": small, "mid": mid, "full": []}, {"small": small_fid, "mid": mid_fid}, "full",
                            ["small", "mid", "full"], top_logprobs=5)
    assert set(cal.pairs) == {"small->mid", "small->full", "mid->full"} and set(cal.heads) == {"small", "mid"}
    to_full, to_mid = cal.pairs["small->full"], cal.pairs["small->mid"]
    assert to_mid.strong_fidelity == pytest.approx(mid_fid.mean()) and to_full.strong_fidelity == 1.0
    finite = [t for t in to_full.thresholds if t is not None]
    assert finite == sorted(finite) and len(finite) < len(FLOOR_GRID)  # no answer is sure to be perfect
    # above mid's mean fidelity, retrying on mid cannot do better: the bar stops rising
    cap = to_mid.threshold(to_mid.strong_fidelity)
    assert to_mid.threshold(0.99) == cap and to_full.threshold(0.99) is None
    assert to_mid.threshold(0.5) == to_full.threshold(0.5)
    assert cal.training["tiers"]["small"]["beats_mean"] is True


def test_the_signal_study_shows_what_each_set_scores() -> None:
    answers, fidelity = synthetic(200, seed=5)
    study = signal_study(answers, fidelity, {"basic": BASIC_FEATURES, "length only": ("log_tokens",)})
    assert study["basic"]["cv_rmse"] < study["length only"]["cv_rmse"]
    assert study["basic"]["spearman"] > 0.8 and abs(study["length only"]["spearman"]) < 0.3


def test_the_look_ahead_is_fitted_on_the_answers_first_tokens() -> None:
    """Answers whose first tokens tell how good they are and whose rest says nothing (every later token sure):
    the look-ahead's head, read on the first 8 tokens, ranks them; the whole answer's signals are diluted."""
    rng = np.random.default_rng(6)
    answers, fidelity = [], []
    for _ in range(300):
        sureness = rng.uniform(0.05, 0.95)
        head = [(math.log(sureness), [math.log(sureness), math.log((1 - sureness) / 2)])] * 8
        tail = [(math.log(0.99), [math.log(0.99), math.log(0.005)])] * int(rng.integers(30, 60))
        answers.append(Answer(10, "some text", list(range(len(head) + len(tail))), "stop", head + tail))
        fidelity.append(float(np.clip(0.2 + 0.8 * sureness + rng.normal(scale=0.05), 0, 1)))
    cal = calibrate_cascade({"small": answers, "full": []}, {"small": np.array(fidelity)}, "full", ["small", "full"],
                            top_logprobs=5, lookahead=8)
    assert cal.lookahead is not None and cal.lookahead.tokens == 8 and cal.training["lookahead"]["tokens"] == 8
    early_head, early_pair = cal.early_pair("small", "full")  # type: ignore[misc]
    whole_head, _ = cal.pair("small", "full")  # type: ignore[misc]
    first = [signal_values(a, first_tokens=8) for a in answers]
    assert all(v is not None and v["stopped"] == 0.0 for v in first)
    early_scores = np.array([early_head.score(v) for v in first])  # type: ignore[arg-type]
    assert np.corrcoef(early_scores, fidelity)[0, 1] > 0.9
    assert cal.training["lookahead"]["tiers"]["small"]["spearman"] > cal.training["tiers"]["small"]["spearman"]
    assert early_pair.threshold(0.8) is not None and whole_head is not early_head
    assert calibrate_cascade({"small": answers, "full": []}, {"small": np.array(fidelity)}, "full",
                             ["small", "full"], top_logprobs=5, lookahead=None).lookahead is None
