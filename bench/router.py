"""Cost–quality curves of `auto`'s policies on held-out prompts, per tier pair, measured two ways.

`.venv/bin/python -m bench.router --train 300 --test 250 --known 200` (see --help). Steps:

1. Train the router's artifact on --train prompts of the training split (training/router_training.py: the
   difficulty heads and the cascade's calibration), or load --artifact.
2. Run two held-out sets through every built tier (answers and scores cached under --work-dir):
   - ShareGPT: --test first turns of the held-out split (a fixed hash puts 10% of ShareGPT there; training
     never draws from it). Quality = fidelity to `full`'s answer (training/fidelity.py; full = 1.0).
   - Known answers: --known questions with answers fixed by a procedure (training/known_answers.py: small
     sums, differences and products, capitals, one-word facts). Quality = accuracy, graded by rule.
3. Per pair weak → strong (each cheaper tier → full, and small → mid), sweep each policy from "all on weak"
   to "all moved to strong", and record each point's mean cost per request (tiers.yaml prices × each
   tier's own prompt and output tokens) and mean quality:
   - random mixing: the straight line between always-weak and always-strong;
   - router: the difficulty model's predicted gain (strong's predicted fidelity − weak's), largest first;
     a moved request runs on strong only;
   - cascade: every request runs on weak; the least confident answers (the artifact's confidence score,
     empty answers first) are retried on strong, billed for both;
   - cascade, look-ahead: the same for streams that decide after their first --lookahead tokens (a
     confidence head fitted here on the training answers' first tokens): a retried request pays for weak's
     prompt and those tokens, not a whole answer;
   - cascade, stop at a near tie: every request runs on weak, which is stopped at its first token whose
     margin between its two most likely tokens (nats, from the same top log-probabilities) is below a
     threshold that grows with the token's place (threshold - slope x position: a late near tie costs less
     of the answer), and retried on strong; a retried request pays for weak's prompt and the tokens up to
     there. Why: `mid` is `full` quantized, so their greedy answers part where `full` sees a near tie, and
     how much of the answer is left after it is what fidelity loses. The slope is chosen on the training
     answers (the most saved at 95% of strong's quality), the threshold swept on the held-out ones;
   - cascade, stop at a divergence risk: the same stop, where the risk that weak has parted from strong so far
     (the sum over its tokens of the rate at which answers parted at a token of that margin on the training
     answers, each weighted by the share of the answer still to come, to a power chosen on the training
     answers) passes a threshold swept on the held-out ones; and at the one threshold chosen on the training
     answers (the first point of their sweep at 95% of strong's quality), which the artifact stores for the gateway
     (its `cascade.stops`, tiers/divergence.py; the artifact trained here is rewritten with it, --out);
   - oracle: requests moved in order of true gain (what no predictor can beat; no double billing).
4. Report, per pair and measure: quality at 11 cost points (0%–100% of the way from always-weak's cost to
   always-strong's), APGR (RouteLLM: the area under the performance gap recovered, (quality − weak) /
   (strong − weak), over the share of requests on strong; random mixing 0.5) and the same area over cost
   (which charges a cascade for its double billing), the cost saved against always-strong at 95% of its
   quality, whether the cascade is at or above random mixing at every point of its sweep up to
   always-strong's cost, and the cascade at the shipped plans' floors (0.8, 0.9) as the artifact's
   thresholds set it. Then the difficulty model's errors (CV on training, held-out) against predicting the
   mean, and which engine signals the confidence needs (CV error per signal set).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from assets import offline_hub
from bench.cost_quality import (
    QUALITY_TARGET,
    PairEval,
    apgr,
    apgr_by_cost,
    evaluate_pair,
    quality_at,
    random_quality,
    stop_curve,
)
from bench.stop_cascade import fit_risk_stop, fit_tie_slope, risk_gaps, tie_gaps, tie_thresholds
from tiers.divergence import HAZARD_EDGES
from training.divergence_fit import fit_stops

offline_hub()

TABLE_PCTS = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)
PLAN_FLOORS = (0.8, 0.9)  # the shipped standard and enterprise plans'

# ---- the report ----

POLICIES = (("random", "random mixing"), ("router", "difficulty router"), ("cascade", "cascade"),
            ("lookahead", "cascade, look-ahead"), ("tie_stop", "cascade, stop at a near tie"),
            ("risk_stop", "cascade, stop at a divergence risk"), ("oracle", "oracle"))


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def pair_table(ev: PairEval, *, title: str, unit: str, floors: dict[float, tuple[float, float, float]]) -> list[str]:
    names = [(k, label) for k, label in POLICIES if k == "random" or k in ev.curves]
    lines = [f"**{title}** — quality = {unit}; always-weak {ev.q_weak:.3f} at {ev.c_weak * 1000:.4f} USD / 1K "
             f"requests, always-strong {ev.q_strong:.3f} at {ev.c_strong * 1000:.4f}", "",
             "| cost (of the way weak → strong) | USD / 1K requests | " + " | ".join(lbl for _, lbl in names) + " |",
             "|---" * (len(names) + 2) + "|"]
    for pct in TABLE_PCTS:
        cost = ev.c_weak + pct / 100 * (ev.c_strong - ev.c_weak)
        cells = []
        for key, _ in names:
            q = (random_quality(np.array([cost]), ev.c_weak, ev.c_strong, ev.q_weak, ev.q_strong)[0] if key == "random"
                 else quality_at(ev.curves[key], cost))
            cells.append("—" if np.isnan(q) else f"{float(q):.3f}")
        lines.append(f"| {pct}% | {cost * 1000:.4f} | " + " | ".join(cells) + " |")
    curves = {k: ev.curves[k] for k, _ in names if k != "random"}
    lines += [
        "",
        "- APGR by share on strong (RouteLLM): " + ", ".join(
            f"{k} {apgr(c.pct_strong, c.quality, ev.q_weak, ev.q_strong):.3f}" for k, c in curves.items())
        + "; by cost: " + ", ".join(f"{k} {apgr_by_cost(c, ev.c_weak, ev.c_strong, ev.q_weak, ev.q_strong):.3f}"
                                    for k, c in curves.items()) + " (random mixing 0.500)",
        f"- cost saved vs always-strong at {QUALITY_TARGET:.0%} of its quality: "
        + ", ".join(f"{k} **{_pct(ev.saving(k))}**" for k, _ in names),
    ]
    for key in ("cascade", "lookahead", "tie_stop", "risk_stop"):
        if key in ev.curves:
            below, of, worst = ev.below_random(key)
            verdict = "yes" if below == 0 else f"no ({below} of {of} points below)"
            lines.append(f"- {key} at or above random mixing at every cost point: **{verdict}** (worst margin "
                         f"{worst:+.4f})")
    for (name, floor), (retried, quality, saving) in floors.items():
        lines.append(f"- {name} at floor {floor:g} (the artifact's threshold): {retried:.0%} retried on strong, "
                     f"quality {quality:.3f}, saving {saving:.1%}")
    return lines


def floor_points(confidence_score: np.ndarray, empty: np.ndarray, thresholds: dict[float, float | None],
                 q_weak: np.ndarray, q_strong: np.ndarray, c_weak: np.ndarray, c_strong: np.ndarray,
                 c_first: np.ndarray | None = None) -> dict[float, tuple[float, float, float]]:
    """The cascade where the artifact's thresholds put it: (share retried, quality, saving vs strong).
    `c_first`: what a retried request's weak attempt cost (a look-ahead cut it)."""
    first = c_weak if c_first is None else c_first
    out = {}
    for floor, threshold in thresholds.items():
        retried = empty | (np.full(len(empty), True) if threshold is None else confidence_score < threshold)
        quality = float(np.where(retried, q_strong, q_weak).mean())
        cost = float(np.where(retried, first + c_strong, c_weak).mean())
        out[floor] = (float(retried.mean()), quality, 1.0 - cost / float(np.mean(c_strong)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=300, help="training-split prompts to fit the artifact on")
    ap.add_argument("--test", type=int, default=250, help="held-out ShareGPT prompts to evaluate on")
    ap.add_argument("--known", type=int, default=200, help="known-answer questions to evaluate on")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy answer length per tier")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--lookahead", type=int, default=None,
                    help="tokens the look-ahead cascade decides after [default: the artifact's, else "
                         "training/confidence.py's LOOKAHEAD]")
    ap.add_argument("--seed", type=int, default=0, help="picks the training and test prompts and the questions")
    ap.add_argument("--artifact", type=Path, default=None,
                    help="evaluate this trained artifact instead of training one (it must come from the train split)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the artifact with the stops fitted here [default: <work-dir>/bench-difficulty.json "
                         "when it is trained here; with --artifact, not written]")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="cache of answers and scores [default <data dir>/router/work, shared with router train]")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's choice]")
    ap.add_argument("--batch", type=int, default=32, help="sequences each engine generates at once")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--models-dir", type=Path, default=None)
    ap.add_argument("--catalogue", type=Path, default=None, help="tier catalogue [default tiers/tiers.yaml]")
    args = ap.parse_args(argv)
    command = ".venv/bin/python -m bench.router " + " ".join(argv if argv is not None else sys.argv[1:])
    print("\n".join(run(args, command.strip())))


def run(args: argparse.Namespace, command: str) -> list[str]:
    from cache.embedder import Embedder
    from gateway.config_files import load_yaml
    from gateway.settings import Settings
    from tiers.catalogue import TierCatalogue
    from tiers.difficulty import load_difficulty_model
    from training.confidence import signal_values
    from training.known_answers import is_correct, known_answer_questions
    from training.router_prompts import conversation, sharegpt_prompts
    from training.router_training import collect, train
    from training.tier_answers import runnable_tiers

    settings = Settings(**{k: v for k, v in {"data_dir": args.data_dir, "models_dir": args.models_dir,
                                              "tiers_file": args.catalogue}.items() if v is not None})
    catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    models_dir = settings.resolved_models_dir
    work_dir = args.work_dir or settings.data_dir / "router" / "work"
    ready, skipped = runnable_tiers(catalogue, models_dir)
    tiers = [s.name for s in ready]
    if "full" not in tiers or len(tiers) < 2:
        sys.exit(f"full and a cheaper tier must be built; skipped: {skipped}")

    def echo(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for name, why in skipped.items():
        echo(f"note: tier {name} is left out: {why}")
    embedder = Embedder(num_threads=None)
    kw: dict[str, Any] = {"max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens,
                          "work_dir": work_dir, "embedder": embedder, "threads": args.threads,
                          "max_num_seqs": args.batch, "echo": echo}
    train_prompts = sharegpt_prompts(args.train, split="train", seed=args.seed)
    if args.artifact:
        model = load_difficulty_model(args.artifact, embedder=embedder)
    else:
        model = train(catalogue, models_dir, work_dir / "bench-difficulty.json", prompts=train_prompts,
                      seed=args.seed, tiers=tiers, reference="full", **kw)
    trained = collect(catalogue, models_dir, train_prompts, tiers=tiers, reference="full", **kw)
    questions = known_answer_questions(args.known, seed=args.seed)
    sets = {"ShareGPT": collect(catalogue, models_dir, sharegpt_prompts(args.test, split="heldout", seed=args.seed),
                                tiers=tiers, reference="full", **kw),
            "known": collect(catalogue, models_dir, [q.prompt for q in questions], tiers=tiers, reference="full",
                             **kw)}
    look, lookahead = _lookahead_heads(model, trained, args.lookahead, args.seed)
    pairs = [(t, "full") for t in tiers if t != "full"] + ([("small", "mid")] if {"small", "mid"} <= set(tiers) else [])
    slopes = {pair: fit_tie_slope(trained, *pair, catalogue, args.max_tokens) for pair in pairs}
    risks = {pair: fit_risk_stop(trained, *pair, catalogue, args.max_tokens) for pair in pairs}
    if model.cascade is not None and not model.cascade.stops:  # an artifact from before the stops: fitted on the
        # training answers by the product's own rule (training/divergence_fit.py `fit_stops`, which `train` ran on a
        # model trained here: its stops are kept as they are), and stored
        model = model.with_stops(fit_stops(trained, pairs, catalogue, args.max_tokens)[0])
        out = args.out or (None if args.artifact else work_dir / "bench-difficulty.json")
        if out is not None:
            model.save(out)
            echo(f"saved {model.version} (with its stops) to {out}")
    lines = [f"Router: `auto`'s policies on held-out prompts, tiers {', '.join(tiers)}. `{command}`", "",
             f"Artifact {model.version}: difficulty heads and cascade calibration from {len(trained.prompts)} "
             f"training-split ShareGPT prompts; greedy answers of {args.max_tokens} tokens (prompts cut to "
             f"{args.max_prompt_tokens}); fidelity = 0.5 x rescaled MiniLM cosine + 0.5 x teacher-forced top-1 "
             "agreement with full's answer; known answers graded by rule (training/known_answers.py).", ""]
    for set_name, col in sets.items():
        predicted = model.predict_batch([conversation(p) for p in col.prompts])
        quality = _qualities(col, set_name, questions, is_correct)
        for weak, strong in pairs:
            cost = {t: np.array([float(catalogue.tiers[t].price(a.num_prompt_tokens, len(a.token_ids)))
                                 for a in col.answers[t]]) for t in (weak, strong)}
            values = [signal_values(a) for a in col.answers[weak]]
            empty = np.array([v is None for v in values])
            head = model.cascade.heads[weak] if model.cascade and weak in model.cascade.heads else None
            conf = np.array([-np.inf if v is None or head is None else head.score(v) for v in values])
            look_conf, c_look = None, None
            if weak in look:
                first = [signal_values(a, first_tokens=lookahead) for a in col.answers[weak]]
                look_conf = np.array([-np.inf if v is None else look[weak].score(v) for v in first])
                # the gateway judges on token lookahead + 1 (it must know whether the answer stopped there)
                c_look = np.array([float(catalogue.tiers[weak].price(a.num_prompt_tokens,
                                                                     min(len(a.token_ids), lookahead + 1)))
                                   for a in col.answers[weak]])
            gain = np.array([p.get(strong, 1.0) - p[weak] for p in predicted])
            ev = evaluate_pair(quality[weak], quality[strong], cost[weak], cost[strong], predicted_gain=gain,
                               confidence=conf, lookahead_confidence=look_conf, c_lookahead=c_look)
            gap, c_upto = tie_gaps(col.answers[weak], catalogue.tiers[weak], slopes[weak, strong], args.max_tokens)
            ev.curves["tie_stop"] = stop_curve(gap, tie_thresholds(gap), quality[weak], quality[strong], cost[weak],
                                               cost[strong], c_upto)
            hazard, power, *_ = risks[weak, strong]
            gap, c_upto = risk_gaps(col.answers[weak], catalogue.tiers[weak], hazard, power, args.max_tokens)
            ev.curves["risk_stop"] = stop_curve(gap, tie_thresholds(gap), quality[weak], quality[strong], cost[weak],
                                                cost[strong], c_upto)
            stop = model.cascade.stop(weak, strong) if model.cascade else None
            stop_line = []
            if stop is not None:  # the artifact's: its own hazard, power and width
                gap, c_upto = risk_gaps(col.answers[weak], catalogue.tiers[weak], np.asarray(stop.hazard),
                                        stop.power, stop.width)
                at = stop_curve(gap, np.array([-stop.threshold]), quality[weak], quality[strong], cost[weak],
                                cost[strong], c_upto)
                stop_line = [f"- risk_stop at the artifact's threshold {stop.threshold:.4f} (power {stop.power:g}, "
                             f"width {stop.width}, chosen on the training answers): {at.pct_strong[1]:.0%} stopped, "
                             f"quality {at.quality[1]:.3f} ({at.quality[1] / ev.q_strong:.1%} of strong's), saving "
                             f"{1 - at.cost[1] / ev.c_strong:.1%}"]
            floors = {}
            pair = model.cascade.pair(weak, strong) if model.cascade else None
            if pair is not None:
                floors = {("cascade", f): point for f, point in floor_points(
                    conf, empty, {f: pair[1].threshold(f) for f in PLAN_FLOORS}, quality[weak], quality[strong],
                    cost[weak], cost[strong]).items()}
            early = model.cascade.early_pair(weak, strong) if model.cascade else None
            if early is not None and look_conf is not None and model.cascade.lookahead.tokens == lookahead:
                floors |= {("lookahead", f): point for f, point in floor_points(
                    look_conf, empty, {f: early[1].threshold(f) for f in PLAN_FLOORS}, quality[weak],
                    quality[strong], cost[weak], cost[strong], c_look).items()}
            unit = "fidelity to full" if set_name == "ShareGPT" else "accuracy"
            what = "held-out ShareGPT prompts" if set_name == "ShareGPT" else "known-answer questions"
            title = f"{weak} → {strong}, {len(col.prompts)} {what}"
            lines += [*pair_table(ev, title=title, unit=unit, floors=floors), *stop_line, ""]
    lines += [f"Stop at a near tie: slope chosen on the training answers, {weak} → {strong}: {slope:g} nats per token"
              for (weak, strong), slope in slopes.items()]
    bins = list(pairwise(HAZARD_EDGES))
    lines += [f"Stop at a divergence risk, {weak} → {strong}: power {power:g} (chosen on the training answers); "
              "the rate at which answers parted per margin bin " + ", ".join(
                  f"[{lo:g}, {hi:g}) {h:.3f}" for (lo, hi), h in zip(bins, hazard, strict=True))
              for (weak, strong), (hazard, power, *_) in risks.items()]
    lines += [f"Its threshold, {weak} → {strong}, on the training answers: " + (
        f"{stop.threshold:.4f}: {fit['stopped']:.0%} stopped, quality {fit['quality']:.3f}, saving {fit['saving']:.1%}"
        + ("" if model.cascade and model.cascade.stop(weak, strong) == stop else " (not in the artifact: it saved "
           "nothing, or the artifact's pairs are others)")
        if stop is not None else "none (the cheap tier keeps the target unstopped, or no threshold reaches it)")
        for (weak, strong), (_, _, stop, fit) in risks.items()] + [""]
    lines += _predictor_lines(model, sets["ShareGPT"], trained)
    lines += _signal_lines(trained, lookahead, args.seed)
    return lines


def _qualities(col: Any, set_name: str, questions: Sequence[Any], is_correct: Any) -> dict[str, np.ndarray]:
    if set_name == "ShareGPT":
        return {t: col.fidelity[t] if t in col.fidelity else np.ones(len(col.prompts)) for t in col.answers}
    by_prompt = {q.prompt: q for q in questions}
    return {t: np.array([float(is_correct(by_prompt[p], a.text)) for p, a in zip(col.prompts, answers, strict=True)])
            for t, answers in col.answers.items()}


def _lookahead_heads(model: Any, trained: Any, lookahead: int | None, seed: int) -> tuple[dict[str, Any], int]:
    """Confidence heads on the first `lookahead` tokens of the training answers, per cheaper tier: the
    artifact's (what the gateway runs) when it has them for that many tokens, else fitted here the same way."""
    from training.confidence import LOOKAHEAD, fit_confidence, signal_values

    early = model.cascade.lookahead if model.cascade is not None else None
    if early is not None and lookahead in (None, early.tokens):
        return early.heads, early.tokens
    lookahead = LOOKAHEAD if lookahead is None else lookahead
    heads = {}
    for tier, fid in trained.fidelity.items():
        rows = [(v, f) for a, f in zip(trained.answers[tier], fid, strict=True)
                if (v := signal_values(a, first_tokens=lookahead)) is not None]
        heads[tier] = fit_confidence([v for v, _ in rows], np.array([f for _, f in rows]), seed=seed)[0]
    return heads, lookahead


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return 0.0 if ra.std() == 0 or rb.std() == 0 else float(np.corrcoef(ra, rb)[0, 1])


def _predictor_lines(model: Any, held: Any, trained: Any) -> list[str]:
    from training.router_prompts import conversation

    predicted = model.predict_batch([conversation(p) for p in held.prompts])
    lines = ["**Difficulty model** (does it predict anything?)", "",
             "| tier | CV RMSE (training) | predicting the mean (CV) | beats the mean | held-out RMSE | "
             "training mean on held-out | held-out Spearman |", "|---|---|---|---|---|---|---|"]
    for tier, head in model.heads.items():
        if tier not in held.fidelity:
            continue
        y, p = held.fidelity[tier], np.array([row[tier] for row in predicted])
        lines.append(f"| {tier} | {head.cv_rmse:.4f} | {head.baseline_rmse:.4f} | {'yes' if head.beats_mean else 'no'}"
                     f" | {np.sqrt(np.mean((p - y) ** 2)):.4f} | {np.sqrt(np.mean((head.mean_fidelity - y) ** 2)):.4f}"
                     f" | {_spearman(p, y):.3f} |")
    return [*lines, ""]


def _signal_lines(trained: Any, lookahead: int, seed: int) -> list[str]:
    """CV error of the confidence per signal set, on the training answers: which signals help."""
    from tiers.cascade import SIGNAL_FEATURES
    from training.confidence import BASIC_FEATURES, signal_study

    sets = {"mean log-probability": ("mean_logprob",),
            "mean log-probability, length, stopped": ("mean_logprob", "log_tokens", "stopped"),
            "chosen-token signals (no alternatives)": BASIC_FEATURES,
            "+ entropy": (*BASIC_FEATURES, "mean_entropy", "max_entropy"),
            "+ margin": (*BASIC_FEATURES, "mean_margin", "min_margin", "low_margin_frac"),
            "all (SIGNAL_FEATURES)": SIGNAL_FEATURES}
    lines = ["**Which engine signals the confidence needs** (5-fold CV on the training answers; RMSE of "
             "fidelity, Spearman of scores with it)", "",
             "| tier | " + " | ".join(sets) + f" | all, first {lookahead} tokens | predicting the mean |",
             "|---" * (len(sets) + 3) + "|"]
    from training.confidence import fit_confidence, signal_values

    for tier, fid in trained.fidelity.items():
        study = signal_study(trained.answers[tier], fid, sets, seed=seed)
        rows = [(v, f) for a, f in zip(trained.answers[tier], fid, strict=True)
                if (v := signal_values(a, first_tokens=lookahead)) is not None]
        head, oof = fit_confidence([v for v, _ in rows], np.array([f for _, f in rows]), seed=seed)
        cells = [f"{s['cv_rmse']:.4f} ({s['spearman']:.2f})" for s in study.values()]
        base = next(iter(study.values()))["baseline_rmse"]
        lines.append(f"| {tier} | " + " | ".join(cells) + f" | {head.ridge.cv_rmse:.4f} "
                     f"({_spearman(oof, np.array([f for _, f in rows])):.2f}) | {base:.4f} |")
    return lines


if __name__ == "__main__":
    main()
