"""The training pipeline end to end on tiny random Llamas (the difficulty heads and the cascade's calibration),
the prompt split, first-use builds, and the benchmark's curve arithmetic (APGR, saving at 95%, above random
mixing, a cascade's double billing)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.cost_quality import (
    apgr,
    apgr_by_cost,
    cascade_curve,
    cost_at_quality,
    evaluate_pair,
    quality_at,
    random_quality,
    stop_curve,
)
from bench.stop_cascade import divergence_hazard, fit_risk_stop, risk_gaps, tie_gaps, tie_thresholds
from gateway.cli.main import cli
from tests.bench.test_stop_cascade import stopped_by
from tests.tiers.test_difficulty import HashEmbedder
from tiers.catalogue import TierCatalogue
from tiers.difficulty import default_artifact_path, load_difficulty_model
from training.divergence_fit import fit_stops
from training.router_prompts import is_heldout, sharegpt_prompts
from training.router_training import RouterTrainingError, collect, ensure_difficulty_model, train
from training.tier_answers import Answer, runnable_tiers

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = ["How do I reverse a list in Python?", "Write a haiku about the sea.",
           "def f(x):\n    return x +\nwhy does this fail?", "Translate 'good morning' into French."]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(PROMPTS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(path: Path, tok: PreTrainedTokenizerFast, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tier(model: Path | str, price: str, **extra: str) -> dict:
    return {"backend": "local", "model": str(model), "dtype": "fp32", "kv_cache_bytes": 1 << 22,
            "price_per_1k_input": price, "price_per_1k_output": price, "hardware_cost_per_hour": "0",
            "context_limit": 512, **extra}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> TierCatalogue:
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("tiny-tiers")
    big = tiny_llama(root / "big", tok, seed=0)
    student = tiny_llama(root / "student", tok, seed=1)
    return TierCatalogue.model_validate({"tiers": {
        "small": tier(student, "0.0001"), "mid": tier(big, "0.0002", quantize="int8"), "full": tier(big, "0.0006"),
        "unbuilt": tier(root / "missing", "0.00005"),
    }})


def test_training_end_to_end_on_tiny_models(catalogue: TierCatalogue, tmp_path: Path) -> None:
    out = tmp_path / "difficulty.json"
    messages: list[str] = []
    model = train(catalogue, tmp_path / "models", out, max_tokens=4, prompts=PROMPTS, work_dir=tmp_path / "work",
                  embedder=HashEmbedder(), threads=1, max_num_seqs=4, progress=False, echo=messages.append)
    assert any("skipping tier unbuilt" in m and "not built" in m for m in messages)
    loaded = load_difficulty_model(out, embedder=HashEmbedder())
    assert loaded.version == model.version and loaded.version.startswith("difficulty-v1:")
    assert loaded.tiers == ["small", "mid", "full"] and loaded.reference == "full"
    assert set(loaded.tier_versions) == {"small", "mid", "full"}
    assert loaded.tier_versions["mid"] != loaded.tier_versions["full"]  # int8 is another model version
    assert loaded.heads["small"].num_train == 4 and loaded.training["max_tokens"] == 4
    pred = loaded.predict([{"role": "user", "content": "What is 2 + 2?"}])
    assert pred["full"] == 1.0 and all(0.0 <= pred[t] <= 1.0 for t in ("small", "mid"))
    # answers and scores are cached: a second run generates nothing and gives the same model
    gen = sorted((tmp_path / "work" / "generations").glob("*.jsonl"))
    assert len(gen) == 3 and all(len(p.read_text().splitlines()) == 4 for p in gen)
    again = train(catalogue, tmp_path / "models", None, max_tokens=4, prompts=PROMPTS, work_dir=tmp_path / "work",
                  embedder=HashEmbedder(), progress=False)
    assert again.version == model.version
    assert all(len(p.read_text().splitlines()) == 4 for p in gen)


def test_the_artifact_carries_a_calibrated_cascade(catalogue: TierCatalogue, tmp_path: Path) -> None:
    prompts = [f"{p} ({i})" for i in range(6) for p in PROMPTS]  # 24: enough for a confidence head
    messages: list[str] = []
    out = tmp_path / "difficulty.json"
    train(catalogue, tmp_path / "models", out, max_tokens=4, prompts=prompts, tiers=["small", "full"],
          work_dir=tmp_path / "work", embedder=HashEmbedder(), threads=1, progress=False, echo=messages.append)
    model = load_difficulty_model(out, embedder=HashEmbedder())
    assert isinstance(model.heads["small"].beats_mean, bool) and model.training["top_logprobs"] == 5
    assert model.cascade is not None and set(model.cascade.heads) == {"small"}
    assert set(model.cascade.pairs) == {"small->full"} and model.cascade.top_logprobs == 5
    head, pair = model.cascade.pair("small", "full")  # type: ignore[misc]
    assert head.ridge.num_train == 24 and len(pair.thresholds) == 101
    assert any(m.startswith("cascade from small: confidence CV RMSE") for m in messages)
    # every answer was kept with its tokens' log-probabilities and 5 alternatives each
    for path in (tmp_path / "work" / "generations").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert rec["top_logprobs"] == 5 and len(rec["logprobs"]) == len(rec["token_ids"])
            assert all(len(top) == 5 and top[0] >= lp - 1e-6 for lp, top in rec["logprobs"])


def test_training_fits_the_cascade_stop_the_benchmark_fits(catalogue: TierCatalogue, tmp_path: Path) -> None:
    # small is another random model (its answers part from full's); twin is full's model at a lower price (the same
    # answers: nothing to stop)
    tiers = catalogue.tiers
    priced = TierCatalogue.model_validate({"tiers": {"small": tier(tiers["small"].model, "0.0001"),
                                                     "twin": tier(tiers["full"].model, "0.0003"),
                                                     "full": tier(tiers["full"].model, "0.0006")}})
    prompts = [f"{p} ({i})" for i in range(6) for p in PROMPTS]  # 24: enough for the cascade's heads
    kw = {"max_tokens": 4, "work_dir": tmp_path / "work", "embedder": HashEmbedder(), "threads": 1, "progress": False}
    messages: list[str] = []
    out = tmp_path / "difficulty.json"
    train(priced, tmp_path / "models", out, prompts=prompts, echo=messages.append, **kw)  # type: ignore[arg-type]
    model = load_difficulty_model(out, embedder=HashEmbedder())
    assert model.cascade is not None and {"small->full", "twin->full"} <= set(model.cascade.pairs)
    assert model.cascade.stop("twin", "full") is None  # twin keeps full's quality unstopped
    fits = model.training["stops"]["pairs"]
    assert "stopped" not in fits["twin->full"] and 0 < fits["small->full"]["stopped"] <= 1
    assert any(m.startswith("cascade stop small->full: ") for m in messages)
    # one implementation: the benchmark's fit on the same answers is what training recorded, and training kept its
    # stop exactly where it saved something on the training answers (on these tiny models small's answers are all
    # far from full's, so keeping the target stops nearly all of them, which costs more than full alone)
    collected = collect(priced, tmp_path / "models", prompts, reference="full", **kw)  # type: ignore[arg-type]
    *_, bench_stop, bench_fit = fit_risk_stop(collected, "small", "full", priced, 4)
    assert bench_stop is not None and bench_fit == fits["small->full"]
    assert bench_stop.width == 4 and bench_stop.quality == pytest.approx(0.95)
    assert bench_fit["quality"] >= bench_stop.quality - 1e-12
    kept = bench_fit["saving"] > 0
    assert model.cascade.stop("small", "full") == (bench_stop if kept else None)
    assert ("+stop:" in model.version) == kept
    # and the gateway's risk, with that stop, stops the share of the training answers the fit recorded
    stopped = [passed or not a.text.strip()
               for passed, a in zip(stopped_by(bench_stop, collected.answers["small"]), collected.answers["small"],
                                    strict=True)]
    assert np.mean(stopped) == pytest.approx(fits["small->full"]["stopped"])


def test_no_stop_where_the_strong_tier_costs_nothing() -> None:
    sure, parted = [(-0.1, [-0.1, -3.0])] * 3, [(-0.7, [-0.7, -0.71])] * 3
    weak = [Answer(5, "a b c", [1, 2, 3], "stop", parted if i % 2 else sure) for i in range(6)]
    strong = [Answer(5, "a b c", [1, 9, 3] if i % 2 else [1, 2, 3], "stop", sure) for i in range(6)]
    trained = SimpleNamespace(answers={"cheap": weak, "strong": strong}, fidelity={"cheap": np.array([1.0, 0.3] * 3)})
    free = TierCatalogue.model_validate({"tiers": {"cheap": tier("m", "0"), "strong": tier("m", "0")}})
    *_, stop, fit = fit_risk_stop(trained, "cheap", "strong", free, 3)
    assert stop is None and "saving" not in fit
    priced = TierCatalogue.model_validate({"tiers": {"cheap": tier("m", "1"), "strong": tier("m", "3")}})
    assert fit_risk_stop(trained, "cheap", "strong", priced, 3)[2] is not None


def test_a_stop_that_saves_nothing_on_the_training_answers_is_recorded_not_kept() -> None:
    """Half of the cheap answers part from the strong one's; at nearly the strong tier's price, stopping them and
    paying for both costs more than always asking the strong tier, so the artifact gets no stop for the pair."""
    sure, parted = [(-0.1, [-0.1, -3.0])] * 3, [(-0.7, [-0.7, -0.71])] * 3
    weak = [Answer(5, "a b c", [1, 2, 3], "stop", parted if i % 2 else sure) for i in range(6)]
    strong = [Answer(5, "a b c", [1, 9, 3] if i % 2 else [1, 2, 3], "stop", sure) for i in range(6)]
    trained = SimpleNamespace(answers={"cheap": weak, "strong": strong}, fidelity={"cheap": np.array([1.0, 0.3] * 3)})
    dear = TierCatalogue.model_validate({"tiers": {"cheap": tier("m", "2.9"), "strong": tier("m", "3")}})
    *_, stop, fit = fit_risk_stop(trained, "cheap", "strong", dear, 3)
    assert stop is not None and fit["saving"] <= 0, fit
    stops, record = fit_stops(trained, [("cheap", "strong")], dear, 3)
    assert stops == {} and record["cheap->strong"] == fit
    cheap = TierCatalogue.model_validate({"tiers": {"cheap": tier("m", "1"), "strong": tier("m", "3")}})
    *_, stop, fit = fit_risk_stop(trained, "cheap", "strong", cheap, 3)
    assert stop is not None and fit["saving"] > 0, fit
    assert fit_stops(trained, [("cheap", "strong")], cheap, 3) == ({"cheap->strong": stop}, {"cheap->strong": fit})


def test_the_int8_tier_is_more_faithful_than_another_model(catalogue: TierCatalogue, tmp_path: Path) -> None:
    model = train(catalogue, tmp_path / "models", None, max_tokens=4, prompts=PROMPTS, tiers=["small", "mid"],
                  work_dir=tmp_path / "work", embedder=HashEmbedder(), threads=1, progress=False)
    # the same weights in int8 agree with full far more than an unrelated random model does
    assert model.heads["mid"].mean_fidelity > model.heads["small"].mean_fidelity


def test_nothing_to_train_without_a_cheaper_tier(catalogue: TierCatalogue, tmp_path: Path) -> None:
    with pytest.raises(RouterTrainingError, match="nothing to predict"):
        train(catalogue, tmp_path, None, prompts=PROMPTS, tiers=["unbuilt", "full"], work_dir=tmp_path,
              embedder=HashEmbedder(), progress=False)
    ready, skipped = runnable_tiers(catalogue, tmp_path)
    assert [s.name for s in ready] == ["small", "mid", "full"] and "unbuilt" in skipped


def test_ensure_builds_once_and_under_a_lock(catalogue: TierCatalogue, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import training.router_training as rt

    calls = []
    real_train = rt.train

    def counting_train(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real_train(*args, prompts=PROMPTS, embedder=HashEmbedder(), **kwargs)

    monkeypatch.setattr(rt, "train", counting_train)
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(ensure_difficulty_model(
        tmp_path, tmp_path / "models", catalogue, max_tokens=2, progress=False, tiers=["mid", "full"])))
        for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and paths == [default_artifact_path(tmp_path)] * 2
    assert load_difficulty_model(paths[0]).tiers == ["mid", "full"]
    # a tier built since (small) has no prediction: the artifact is stale and rebuilt once
    messages: list[str] = []
    ensure_difficulty_model(tmp_path, tmp_path / "models", catalogue, max_tokens=2, progress=False,
                            echo=messages.append)
    assert len(calls) == 2 and any("stale" in m for m in messages)
    ensure_difficulty_model(tmp_path, tmp_path / "models", catalogue, max_tokens=2, progress=False)
    assert len(calls) == 2
    # a broken artifact is replaced
    default_artifact_path(tmp_path).write_text("{")
    ensure_difficulty_model(tmp_path, tmp_path / "models", catalogue, max_tokens=2, progress=False)
    assert len(calls) == 3 and load_difficulty_model(default_artifact_path(tmp_path)).tiers == ["small", "mid", "full"]


def test_prompt_split_is_fixed_and_disjoint() -> None:
    pool = [f"prompt number {i}: tell me about topic {i * 7}" for i in range(2000)] + ["", "hi", PROMPTS[0]] * 3
    heldout = sharegpt_prompts(50, split="heldout", seed=0, pool=pool)
    train_a = sharegpt_prompts(300, split="train", seed=0, pool=pool)
    train_b = sharegpt_prompts(300, split="train", seed=1, pool=pool)
    assert not set(heldout) & (set(train_a) | set(train_b))
    assert all(is_heldout(p) for p in heldout) and not any(is_heldout(p) for p in train_a)
    assert len(set(train_a)) == 300 and train_a != train_b and "hi" not in train_a
    assert sharegpt_prompts(300, split="train", seed=0, pool=pool) == train_a
    held_share = sum(is_heldout(p) for p in pool[:2000]) / 2000
    assert 0.07 < held_share < 0.13
    with pytest.raises(RouterTrainingError):
        sharegpt_prompts(5000, split="heldout", pool=pool)


def test_router_train_help() -> None:
    result = CliRunner().invoke(cli, ["router", "train", "--help"])
    assert result.exit_code == 0
    for flag in ("--prompts", "--max-tokens", "--tiers", "--out", "--seed", "agreement"):
        assert flag in result.output


# ---- the benchmark's arithmetic ----

def test_apgr_on_synthetic_curves() -> None:
    x = np.linspace(0, 1, 101)
    assert apgr(x, 0.6 + 0.4 * x, 0.6, 1.0) == pytest.approx(0.5)  # random mixing
    assert apgr(np.array([0, 1e-3, 1]), np.array([0.6, 1.0, 1.0]), 0.6, 1.0) == pytest.approx(1.0, abs=1e-3)
    assert apgr(x, np.full_like(x, 0.6), 0.6, 1.0) == 0.0  # a router that never recovers anything
    assert apgr(x, np.ones_like(x), 1.0, 1.0) == 1.0  # no gap to recover


def test_router_and_cascade_curves_perfect_random_and_reversed() -> None:
    rng = np.random.default_rng(0)
    n = 2000
    fid = np.where(rng.uniform(size=n) < 0.2, 0.1, 1.0)  # 20% of requests the cheap tier fails at
    cw, cs, strong = np.full(n, 1.0), np.full(n, 6.0), np.ones(n)
    perfect = evaluate_pair(fid, strong, cw, cs, predicted_gain=1 - fid, confidence=fid)
    router, cascade, oracle = (perfect.curves[k] for k in ("router", "cascade", "oracle"))
    assert apgr(router.pct_strong, router.quality, 0.82, 1.0) == pytest.approx(0.9, abs=0.01)  # 1 - 0.2 / 2
    assert apgr(oracle.pct_strong, oracle.quality, 0.82, 1.0) == pytest.approx(0.9, abs=0.01)
    # always-cheap quality 0.82; 95% needs 0.13 / 0.9 of the requests on full: the router pays 5 more for each,
    # the cascade 6 (it paid for the cheap answer too)
    assert perfect.saving("router") == pytest.approx(1 - (1 + 0.13 / 0.9 * 5) / 6, abs=0.01)
    assert perfect.saving("cascade") == pytest.approx(1 - (1 + 0.13 / 0.9 * 6) / 6, abs=0.01)
    share = (0.95 - fid.mean()) / (1 - fid.mean())  # random mixing moves that share of the requests
    assert perfect.saving("random") == pytest.approx(1 - (1 + share * 5) / 6)
    assert perfect.below_random("cascade")[0] == 0
    assert apgr_by_cost(cascade, 1.0, 6.0, 0.82, 1.0) < apgr_by_cost(router, 1.0, 6.0, 0.82, 1.0)
    coin = evaluate_pair(fid, strong, cw, cs, predicted_gain=rng.uniform(size=n), confidence=rng.uniform(size=n))
    c = coin.curves["router"]
    assert apgr(c.pct_strong, c.quality, 0.82, 1.0) == pytest.approx(0.5, abs=0.05)
    assert coin.below_random("cascade")[0] > 0  # paying twice for a coin flip is worse than mixing
    backwards = evaluate_pair(fid, strong, cw, cs, predicted_gain=fid, confidence=-fid)
    below, of, worst = backwards.below_random("cascade")
    assert below == of - 1 and worst < 0  # all but the start


def test_saving_at_95_percent_and_equal_cost_random_line() -> None:
    fid = np.array([0.0, 1.0, 1.0, 1.0])  # one hard request out of four: always-cheap quality 0.75
    cw, cs = np.ones(4), np.full(4, 5.0)
    ev = evaluate_pair(fid, np.ones(4), cw, cs, predicted_gain=1 - np.array([0.1, 0.9, 0.8, 0.7]),
                       confidence=np.array([0.1, 0.9, 0.8, 0.7]))
    # the router sends the hard one first: full quality at cost (5 + 3) / 4 = 2.0; 95% is reached 80% of the way
    curve = ev.curves["router"]
    assert curve.quality[1] == 1.0 and curve.cost[1] == 2.0
    assert cost_at_quality(curve, 0.95) == pytest.approx(1.0 + 0.8 * 1.0)
    assert ev.saving("router") == pytest.approx(1 - 1.8 / 5.0)
    assert ev.curves["cascade"].cost[1] == pytest.approx(2.25)  # the hard one is paid on both tiers
    # random mixing reaches 0.95 at p = 0.8: cost 1 + 0.8 * 4 = 4.2
    assert ev.saving("random") == pytest.approx(1 - 4.2 / 5.0)
    assert random_quality(np.array([1.0, 3.0, 5.0]), 1.0, 5.0, 0.75, 1.0) == pytest.approx([0.75, 0.875, 1.0])
    assert quality_at(curve, np.array([0.5, 1.5, 3.0])) == pytest.approx([np.nan, 0.875, 1.0], nan_ok=True)


def test_a_stream_look_ahead_pays_only_for_the_tokens_it_read() -> None:
    fid, strong = np.array([0.0, 1.0]), np.ones(2)
    whole = cascade_curve(np.array([0, 1]), fid, strong, np.full(2, 2.0), np.full(2, 6.0))
    early = cascade_curve(np.array([0, 1]), fid, strong, np.full(2, 2.0), np.full(2, 6.0), np.full(2, 0.5))
    assert whole.cost[1] == pytest.approx((2 + 8) / 2) and early.cost[1] == pytest.approx((2 + 6.5) / 2)
    assert early.quality[1] == whole.quality[1] == 1.0


def test_a_near_tie_stop_pays_for_the_tokens_made_until_it_stopped() -> None:
    # two requests of 3 tokens: the first has a near tie (gap 0.1) at its token 1, the second none below 2.0
    gap = np.array([[3.0, 0.1, 0.5], [2.0, 2.5, np.inf]])
    c_upto = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    fid, strong, cw, cs = np.array([0.2, 1.0]), np.ones(2), np.full(2, 3.0), np.full(2, 9.0)
    curve = stop_curve(gap, tie_thresholds(gap), fid, strong, cw, cs, c_upto)
    assert tie_thresholds(gap) == pytest.approx([0.1, 2.0, 3.0], abs=1e-6)  # where a stop moves
    # at 0.1+: the first stops at token 1 (pays 2 of weak, 9 of strong), the second keeps its whole answer
    assert curve.pct_strong[1] == 0.5 and curve.cost[1] == pytest.approx((11 + 3) / 2)
    assert curve.quality[1] == pytest.approx(1.0)
    # at 3.0+: both stop at their token 0
    assert curve.cost[-1] == pytest.approx((1 + 9) * 2 / 2) and curve.pct_strong[-1] == 1.0


def test_tie_gaps_read_the_margin_and_give_later_tokens_slack() -> None:
    tier = TierCatalogue.model_validate({"tiers": {"mid": {
        "backend": "local", "model": "m", "price_per_1k_input": "1", "price_per_1k_output": "2",
        "hardware_cost_per_hour": "0", "context_limit": 100}}}).tiers["mid"]
    answers = [Answer(10, "hi there", [5, 6], "stop", [(-0.1, [-0.1, -0.3]), (-0.01, [-0.01, -5.0])]),
               Answer(10, "", [2], "stop", [(-0.2, [-0.2, -2.0])])]
    gap, cost = tie_gaps(answers, tier, 0.5, 4)
    assert gap[0, :2] == pytest.approx([0.2, 4.99 + 0.5])
    assert np.isinf(gap[0, 2:]).all() and gap[0, 2] > 0  # past the answer's end: never stops there
    assert gap[1, 0] == -np.inf  # an empty answer is always retried, at its first token
    assert cost[0, :2] == pytest.approx([(10 + 2 * 1) / 1000, (10 + 2 * 2) / 1000])


def test_divergence_risk_grows_with_near_ties_and_counts_late_ones_less() -> None:
    top = {"tie": [-0.7, -0.71], "sure": [-0.01, -6.0]}
    weak = [Answer(4, "a b", [1, 2], "stop", [(-0.7, top["tie"]), (-0.01, top["sure"])]),
            Answer(4, "c d", [3, 4], "stop", [(-0.01, top["sure"]), (-0.7, top["tie"])])]
    strong = [Answer(4, "x", [9, 2], "stop"), Answer(4, "c", [3, 4], "stop")]
    hazard = divergence_hazard(weak, strong)
    # the first pair parted at its near tie (margin 0.01, bin [0, 0.02)); the second never did
    assert hazard[0] == pytest.approx(1.1 / 3.0) and hazard[0] > hazard[-2]
    tier = TierCatalogue.model_validate({"tiers": {"mid": {
        "backend": "local", "model": "m", "price_per_1k_input": "1", "price_per_1k_output": "2",
        "hardware_cost_per_hour": "0", "context_limit": 100}}}).tiers["mid"]
    gap, _ = risk_gaps(weak, tier, hazard, 1.0, 2)
    assert (np.diff(gap, axis=1) <= 0).all()  # the risk so far only grows
    assert gap[0, 0] < gap[1, 1]  # an early near tie risks more of the answer than a late one
