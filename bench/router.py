"""The cost–quality curve of the difficulty router on held-out ShareGPT prompts, with RouteLLM's APGR.

`.venv/bin/python -m bench.router --train 400 --test 200` (see --help). Steps:

1. Train the difficulty predictor on --train prompts of the training split (training/router_training.py),
   for the cheap tier and `full` only, or load --artifact.
2. Run --test prompts of the held-out split (10% of ShareGPT's first turns, chosen by a fixed hash that
   training never draws from) through the cheap tier and `full`; score each cheap answer's fidelity to
   full's (full = 1.0). Answers and scores are cached under --work-dir, so a re-run only recomputes the
   curve.
3. Route: sort the held-out requests by predicted fidelity of the cheap tier and send the k least faithful
   to `full`, for k = 0…N (a quality-floor threshold swept over the predictor's output). Each point has
   the fraction of calls sent to full, the mean cost per request (tiers.yaml prices × each tier's own
   prompt and output tokens) and the mean quality (mean fidelity; full's answers count 1.0).
4. Compare with always-full, always-cheap, random mixing at equal cost (the straight line between them)
   and the oracle (sorted by true fidelity: the best any predictor could do on these labels).

Reported: APGR (RouteLLM: the area under the performance gap recovered, (quality − cheap) / (full −
cheap), over the fraction of calls to the strong model; random mixing scores 0.5, a router that needed
no calls to full to reach full's quality would score 1), the cost saving against always-full at 95% of
full's quality, and whether the router's quality is at or above random mixing at every cost point.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from assets import offline_hub

offline_hub()

QUALITY_TARGET = 0.95  # of full's quality
TABLE_PCTS = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)


@dataclass
class Curve:
    """One routing policy swept from 0% to 100% of calls to the strong tier (N + 1 points)."""

    pct_strong: np.ndarray  # fraction of calls sent to the strong tier
    cost: np.ndarray  # mean cost per request
    quality: np.ndarray  # mean fidelity


def routing_curve(order: np.ndarray, fidelity: np.ndarray, cost_weak: np.ndarray, cost_strong: np.ndarray) -> Curve:
    """Send requests to the strong tier in `order` (first = most in need); point k has the first k strong."""
    n = len(fidelity)
    f, cw, cs = fidelity[order], cost_weak[order], cost_strong[order]
    k = np.arange(n + 1)
    gain = np.concatenate([[0.0], np.cumsum(1.0 - f)])  # quality added by sending the first k to strong
    extra = np.concatenate([[0.0], np.cumsum(cs - cw)])
    return Curve(k / n, (cw.sum() + extra) / n, (f.sum() + gain) / n)


def router_curve(predicted: np.ndarray, fidelity: np.ndarray, cost_weak: np.ndarray,
                 cost_strong: np.ndarray) -> Curve:
    """The threshold sweep: lowest predicted fidelity goes to the strong tier first (ties in input order)."""
    return routing_curve(np.argsort(predicted, kind="stable"), fidelity, cost_weak, cost_strong)


def apgr(pct_strong: np.ndarray, quality: np.ndarray, q_weak: float, q_strong: float) -> float:
    """Average performance gap recovered: ∫₀¹ (quality − q_weak) / (q_strong − q_weak) d(pct to strong)."""
    gap = q_strong - q_weak
    if gap <= 0:
        return 1.0  # the weak tier is already as good: nothing to recover
    pgr = (np.asarray(quality) - q_weak) / gap
    x = np.asarray(pct_strong)
    return float(np.sum((pgr[1:] + pgr[:-1]) / 2 * np.diff(x)))


def cost_at_quality(curve: Curve, target: float) -> float | None:
    """The lowest cost at which the curve reaches `target` quality (linear between points), or None."""
    q, c = curve.quality, curve.cost
    hits = np.nonzero(q >= target - 1e-12)[0]
    if len(hits) == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(c[0])
    t = (target - q[i - 1]) / (q[i] - q[i - 1])
    return float(c[i - 1] + t * (c[i] - c[i - 1]))


def random_quality(cost: np.ndarray, c_weak: float, c_strong: float, q_weak: float, q_strong: float) -> np.ndarray:
    """Random mixing: sending a fraction p to the strong tier costs and earns p of the way between the two."""
    p = np.clip((np.asarray(cost) - c_weak) / (c_strong - c_weak), 0.0, 1.0) if c_strong != c_weak else 0.0
    return q_weak + p * (q_strong - q_weak)


@dataclass
class Evaluation:
    n: int
    router: Curve
    oracle: Curve
    c_weak: float
    c_strong: float
    q_weak: float
    q_strong: float
    apgr_router: float
    apgr_oracle: float
    min_margin_vs_random: float  # router quality − random mixing's at the same cost, worst point
    points_below_random: int
    saving_router: float | None  # 1 − cost / always-full's cost at QUALITY_TARGET × full's quality
    saving_random: float | None
    saving_oracle: float | None
    pct_strong_at_target: float | None
    predicted_rmse: float  # held-out error of the predictor
    baseline_rmse: float  # held-out error of predicting the training mean
    spearman: float


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def evaluate(predicted: np.ndarray, fidelity: np.ndarray, cost_weak: np.ndarray, cost_strong: np.ndarray, *,
             train_mean: float | None = None, tolerance: float = 1e-9) -> Evaluation:
    predicted, fidelity = np.asarray(predicted, float), np.asarray(fidelity, float)
    cost_weak, cost_strong = np.asarray(cost_weak, float), np.asarray(cost_strong, float)
    n = len(fidelity)
    router = router_curve(predicted, fidelity, cost_weak, cost_strong)
    oracle = routing_curve(np.argsort(fidelity, kind="stable"), fidelity, cost_weak, cost_strong)
    q_weak, q_strong = float(fidelity.mean()), 1.0
    c_weak, c_strong = float(cost_weak.mean()), float(cost_strong.mean())
    margin = router.quality - random_quality(router.cost, c_weak, c_strong, q_weak, q_strong)
    target = QUALITY_TARGET * q_strong

    def saving(cost: float | None) -> float | None:
        return None if cost is None else 1.0 - cost / c_strong

    rand_cost = c_weak if q_weak >= target else c_weak + (target - q_weak) / (q_strong - q_weak) * (c_strong - c_weak)
    hit = np.nonzero(router.quality >= target - 1e-12)[0]
    mean = fidelity.mean() if train_mean is None else train_mean
    return Evaluation(
        n, router, oracle, c_weak, c_strong, q_weak, q_strong,
        apgr(router.pct_strong, router.quality, q_weak, q_strong),
        apgr(oracle.pct_strong, oracle.quality, q_weak, q_strong),
        float(margin.min()), int(np.sum(margin < -tolerance)),
        saving(cost_at_quality(router, target)), saving(rand_cost), saving(cost_at_quality(oracle, target)),
        float(router.pct_strong[hit[0]]) if len(hit) else None,
        float(np.sqrt(np.mean((predicted - fidelity) ** 2))), float(np.sqrt(np.mean((mean - fidelity) ** 2))),
        _spearman(predicted, fidelity),
    )


def _at_pct(curve: Curve, pct: float) -> tuple[float, float]:
    i = round(pct / 100 * (len(curve.pct_strong) - 1))
    return float(curve.cost[i]), float(curve.quality[i])


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def report(ev: Evaluation, *, cheap: str, command: str, train_info: str) -> str:
    """The table and summary, as markdown (ready for BENCHMARKS.md)."""
    lines = [
        f"Router: `{cheap}` vs `full` on {ev.n} held-out ShareGPT prompts. `{command}`",
        "",
        f"{train_info}",
        "",
        "| calls to full | cost / 1K requests (USD) | router quality | random mixing, same cost | oracle |",
        "|---|---|---|---|---|",
    ]
    for pct in TABLE_PCTS:
        cost, q = _at_pct(ev.router, pct)
        rand = float(random_quality(np.array([cost]), ev.c_weak, ev.c_strong, ev.q_weak, ev.q_strong)[0])
        _, q_or = _at_pct(ev.oracle, pct)
        lines.append(f"| {pct}% | {cost * 1000:.4f} | {q:.3f} | {rand:.3f} | {q_or:.3f} |")
    above = "yes" if ev.points_below_random == 0 else f"no ({ev.points_below_random} of {ev.n + 1} points below)"
    lines += [
        "",
        f"- always-{cheap}: quality {ev.q_weak:.3f}, {ev.c_weak * 1000:.4f} USD / 1K requests; always-full: "
        f"quality 1.000, {ev.c_strong * 1000:.4f} USD / 1K requests",
        f"- APGR: router **{ev.apgr_router:.3f}** (random mixing 0.500, oracle {ev.apgr_oracle:.3f})",
        f"- cost saving vs always-full at {QUALITY_TARGET:.0%} of full's quality: router **{_pct(ev.saving_router)}**"
        f" ({_pct(ev.pct_strong_at_target)} of calls to full), random mixing {_pct(ev.saving_random)}, "
        f"oracle {_pct(ev.saving_oracle)}",
        f"- router at or above random mixing at every cost point: **{above}** (worst margin "
        f"{ev.min_margin_vs_random:+.4f})",
        f"- predictor on the held-out prompts: RMSE {ev.predicted_rmse:.4f} vs {ev.baseline_rmse:.4f} for the "
        f"training mean; Spearman {ev.spearman:.3f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=400, help="training-split prompts to fit the predictor on")
    ap.add_argument("--test", type=int, default=200, help="held-out prompts to evaluate on")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy answer length per tier")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--cheap", choices=["small", "mid"], default=None,
                    help="the cheap tier [default: small if its model is built, else mid]")
    ap.add_argument("--seed", type=int, default=0, help="picks the training and test prompts")
    ap.add_argument("--artifact", type=Path, default=None,
                    help="evaluate this trained artifact instead of training one (it must come from the train split)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="cache of answers and scores [default <data dir>/router/work, shared with router train]")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's choice]")
    ap.add_argument("--batch", type=int, default=32, help="sequences each engine generates at once")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--models-dir", type=Path, default=None)
    ap.add_argument("--catalogue", type=Path, default=None, help="tier catalogue [default tiers/tiers.yaml]")
    args = ap.parse_args(argv)

    from cache.embedder import Embedder
    from gateway.config_files import load_yaml
    from gateway.settings import Settings
    from tiers.catalogue import TierCatalogue
    from tiers.difficulty import load_difficulty_model
    from training.router_prompts import conversation, sharegpt_prompts
    from training.router_training import collect, train
    from training.tier_answers import runnable_tiers

    settings = Settings(**{k: v for k, v in {"data_dir": args.data_dir, "models_dir": args.models_dir,
                                              "tiers_file": args.catalogue}.items() if v is not None})
    catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    models_dir = settings.resolved_models_dir
    work_dir = args.work_dir or settings.data_dir / "router" / "work"
    ready, skipped = runnable_tiers(catalogue, models_dir)
    names = {s.name for s in ready}
    cheap = args.cheap or ("small" if "small" in names else "mid")
    if cheap not in names:
        sys.exit(f"tier {cheap} cannot run: {skipped.get(cheap, 'not in the catalogue')}")
    if "small" not in names and args.cheap is None:
        print(f"note: small is not built ({skipped.get('small')}); comparing mid with full", file=sys.stderr)

    def echo(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    embedder = Embedder(num_threads=None)
    if args.artifact:
        model = load_difficulty_model(args.artifact, embedder=embedder)
    else:
        model = train(catalogue, models_dir, work_dir / f"bench-difficulty-{cheap}.json", num_prompts=args.train,
                      max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                      tiers=[cheap, "full"], reference="full", work_dir=work_dir, embedder=embedder,
                      threads=args.threads, max_num_seqs=args.batch, echo=echo)
    if cheap not in model.heads:
        sys.exit(f"the difficulty model {model.version} has no prediction for {cheap}")
    held = sharegpt_prompts(args.test, split="heldout", seed=args.seed)
    col = collect(catalogue, models_dir, held, tiers=[cheap, "full"], reference="full", max_tokens=args.max_tokens,
                  max_prompt_tokens=args.max_prompt_tokens, work_dir=work_dir, embedder=embedder,
                  threads=args.threads, max_num_seqs=args.batch, echo=echo)
    predicted = np.array([p[cheap] for p in model.predict_batch([conversation(p) for p in col.prompts])])
    weak, strong = catalogue.tiers[cheap], catalogue.tiers["full"]
    # prices are Decimal; the curve is a mean over requests, reported to 4 decimals per 1K requests
    cost_weak = np.array([float(weak.price(a.num_prompt_tokens, len(a.token_ids))) for a in col.answers[cheap]])
    cost_strong = np.array([float(strong.price(a.num_prompt_tokens, len(a.token_ids))) for a in col.answers["full"]])
    ev = evaluate(predicted, col.fidelity[cheap], cost_weak, cost_strong, train_mean=model.heads[cheap].mean_fidelity)
    head = model.heads[cheap]
    train_info = (f"Predictor {model.version}: ridge on MiniLM + {len(model.to_json()['features']['simple'])} simple "
                  f"features, {head.num_train} training prompts, CV RMSE {head.cv_rmse:.4f} (mean-only "
                  f"{head.baseline_rmse:.4f}); greedy answers of {args.max_tokens} tokens, prompts cut to "
                  f"{args.max_prompt_tokens} tokens; fidelity = 0.5 x rescaled MiniLM cosine + 0.5 x teacher-forced "
                  "top-1 agreement with full's answer.")
    command = ".venv/bin/python -m bench.router " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(ev, cheap=cheap, command=command.strip(), train_info=train_info))


if __name__ == "__main__":
    main()
