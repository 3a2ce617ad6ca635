"""The cache's error bound on held-out near misses and paraphrases: a static threshold and learned ones, side by side.

    .venv/bin/python -m bench.cache_bound [--per-kind 400] [--passes 6] [--edit-share 0.1]
        [--vectors-cache /tmp/bound_vectors.npz] [--show-false-hits KIND ... [--show-arm ARM ...]] [--arm ARM ...]

Sets: bench/near_miss_sets.py (meaning-changing edits of held-out ShareGPT questions in 8 kinds, GPTCache's
held-out paraphrase pairs, rule-based rewrites), fixed before the bound existed and not tuned on it.

Setup. Each arm gets its own SemanticCache (SQLite in memory, real MiniLM through a memo of batch embeddings), one
tenant scope holding every original question; an original's answer is an id of its meaning. The tier is an
oracle: asked a paraphrase it answers what its own original says, asked an edited question it answers something
new (the edit needs another answer), so `same_answer` labels are exactly right or wrong. Arms, one run:
- static: `TenantPolicy()` (threshold 0.8 and the near-miss guards, no bound);
- bound 1%: `max_error_rate=0.01, shadow_rate=0.05` (the plans' defaults, quotas/plans.py `CachePlan`);
- bound 5%: `max_error_rate=0.05, shadow_rate=0.05`;
- static + meaning, bound 1% + meaning: the same with the meaning check (cache/meaning_check.py, the plan setting
  `cache.meaning_check`): a candidate the threshold and the guards accept is served only if the NLI cross-encoder
  reads the new question as asking what the cached one asked. Its accept margin was calibrated on the training
  side of the same split (bench/meaning_threshold.py), not on these sets.

Stream. Every held-out lookup (edits of all kinds and paraphrases) once per pass, reshuffled each pass (seeded):
a tenant's traffic repeats kinds of questions, here the very same texts, which is the bound's best case for
learning and the fairest way to show what it learns. Nothing new is stored: every lookup meets the originals only,
so each pass measures the same thing with more evidence behind the threshold (storing the tier's answers would
make later passes exact hits of the same text, right by construction, and hide the semantic layer). For each
lookup: a hit is served (wrong when its answer is not the oracle's: an edit served the original's answer, or a
paraphrase served another original's); a miss with a near candidate, or a hit sampled for a shadow check, is
labelled with the oracle's answer (`SemanticCache.label`). Shadow sampling uses the cache's `rng`, seeded per arm.
All edits make about two thirds of the stream, far more near misses than most tenants send; `--edit-share` keeps
every paraphrase and samples that share of edits anew each pass, to see the bound on gentler traffic.

Measures. First, every static threshold at once on pass 1 (hits at similarity >= t): the error the learned
threshold can reach at each similarity. Then per arm, per pass and for passes 2..N together: the share of served
hits that were wrong (what the bound bounds); edits served among edit lookups, overall and per kind (the issue's
false-hit rate); paraphrase recall = right hits / reachable paraphrases (cosine to their own original >= 0.8) and
precision = right / all paraphrase hits; the learned threshold at the end of each pass (`cache.bounds.states()`),
the labels the window holds, and how many near misses and shadow checks were labelled (a shadow check is a tier
call billed to us).

`--show-false-hits KIND` (repeatable) also lists, for the arms of `--show-arm` (default: static + meaning), the
wrong hits of that kind served in any pass: the edited query, the original whose answer it got, and in how many
passes. It is for reading what slips through, by category; it does not change the figures.

`--arm ARM` (repeatable) runs only those arms (default: all). The static arms learn nothing, so their passes 2-N
repeat pass 1's decisions: `--arm static --arm "static + meaning" --passes 2` gives their figures of a full run in
a fraction of its time.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from assets import offline_hub
from bench.cache import MemoEmbedder, chat, embed_all, new_cache, pct
from bench.near_miss_sets import KINDS, Case, build
from cache import Embedder, Hit, Miss, SemanticCache, TenantPolicy

ARMS = {"static": TenantPolicy(),
        "bound 1%": TenantPolicy(max_error_rate=0.01, shadow_rate=0.05),
        "bound 5%": TenantPolicy(max_error_rate=0.05, shadow_rate=0.05),
        "static + meaning": TenantPolicy(meaning_check=True),
        "bound 1% + meaning": TenantPolicy(max_error_rate=0.01, shadow_rate=0.05, meaning_check=True)}
SWEEP = (0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.98, 0.99)  # static thresholds compared; 0.7 is the bound's floor
REACHABLE = 0.8  # cosine to its own original from which a paraphrase counts as reachable
SOURCES = ("paraphrase:rules", "paraphrase:gptcache")
TARGETS = "edits served <= 1% overall and <= 2% per kind; paraphrase recall >= 60% of reachable at precision " \
          ">= 0.97; GPTCache pairs served >= 85%"


@dataclass
class Tally:
    """Counts of one arm over some lookups, by case kind (an edit kind or a paraphrase source)."""

    lookups: Counter[str] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    wrong: Counter[str] = field(default_factory=Counter)  # served an answer other than the oracle's
    reachable: Counter[str] = field(default_factory=Counter)
    right_reachable: Counter[str] = field(default_factory=Counter)
    near_labels: int = 0
    shadow_labels: int = 0
    threshold: str = ""  # at the end of the lookups counted
    window_labels: int = 0
    wrong_pairs: dict[str, Counter[tuple[str, str]]] = field(default_factory=dict)  # kind -> (query, served's original)

    def add(self, other: Tally) -> None:
        for name in ("lookups", "served", "wrong", "reachable", "right_reachable"):
            getattr(self, name).update(getattr(other, name))
        self.near_labels += other.near_labels
        self.shadow_labels += other.shadow_labels
        for kind, pairs in other.wrong_pairs.items():
            self.wrong_pairs.setdefault(kind, Counter()).update(pairs)
        self.threshold, self.window_labels = other.threshold, other.window_labels

    def count(self, item: Lookup, right: bool | None) -> None:
        """One lookup: `right` None when nothing was served, else whether the answer served was the oracle's."""
        kind = item.case.kind
        self.lookups[kind] += 1
        self.reachable[kind] += item.reachable
        if right is not None:
            self.served[kind] += 1
            self.wrong[kind] += not right
            self.right_reachable[kind] += right and item.reachable

    def total(self, counter: Counter[str], kinds: tuple[str, ...]) -> int:
        return sum(counter[k] for k in kinds)


@dataclass(frozen=True, slots=True)
class Lookup:
    """One held-out question and what the oracle tier answers it."""

    case: Case
    answer: str
    reachable: bool


def oracle(cases: list[Case], originals: dict[str, str], vectors: dict[str, np.ndarray]) -> list[Lookup]:
    """Paraphrases: their original's answer; edits: a new answer of their own. A query that is another original
    word for word gets that original's answer (the tier answers the same text the same way)."""
    fresh: dict[str, str] = {}
    out = []
    for c in cases:
        if c.query in originals:
            answer = originals[c.query]
        elif c.is_paraphrase:
            answer = originals[c.original]
        else:
            answer = fresh.setdefault(c.query, f"fresh answer {len(fresh)}")
        cosine = float(vectors[c.query] @ vectors[c.original])
        out.append(Lookup(c, answer, c.is_paraphrase and cosine >= REACHABLE))
    return out


def threshold_of(cache: SemanticCache) -> tuple[str, int]:
    state = cache.bounds.states().get("bench")
    if state is None:
        return "0.800 (static)", 0
    if state.threshold is None:
        return "0.800 (static, few labels)", state.labels
    return ("none (exact only)" if state.threshold == np.inf else f"{state.threshold:.3f}"), state.labels


def run_arm(name: str, policy: TenantPolicy, embedder: MemoEmbedder, originals: dict[str, str],
            lookups: list[Lookup], orders: list[list[int]], seed: int, window: int,
            show: frozenset[str] = frozenset()) -> tuple[list[Tally], list[str]]:
    """One arm's stream: a Tally per pass, and the threshold after every `window` lookups. For the kinds in `show`,
    each Tally also keeps the wrong hits served: (query, the original whose answer was served)."""
    asked = {answer: question for question, answer in originals.items()}
    cache, scope = new_cache(embedder)
    if policy.meaning_check:
        cache.meaning.load()  # fail loudly: without its model every candidate would be refused, quietly
    cache.rng.seed(seed)  # the shadow-check draws
    for question, answer in originals.items():
        cache.store(scope, chat(question), answer)
    tallies, trajectory, done = [], [], 0
    for number, order in enumerate(orders, 1):
        t0, tally = time.perf_counter(), Tally()
        for i in order:
            item = lookups[i]
            result = cache.lookup(scope, chat(item.case.query), policy=policy)
            tally.count(item, result.response == item.answer if isinstance(result, Hit) else None)
            if item.case.kind in show and isinstance(result, Hit) and result.response != item.answer:
                served = asked.get(result.response, result.response)
                tally.wrong_pairs.setdefault(item.case.kind, Counter())[(item.case.query, served)] += 1
            checked = (isinstance(result, Hit) and result.shadow_rate > 0) or (isinstance(result, Miss) and result.near)
            if checked and cache.label(result, policy, item.answer) is not None:
                tally.near_labels += isinstance(result, Miss)
                tally.shadow_labels += isinstance(result, Hit)
            done += 1
            if done % window == 0:
                trajectory.append(threshold_of(cache)[0].split(" ")[0])
        tally.threshold, tally.window_labels = threshold_of(cache)
        tallies.append(tally)
        print(f"{name}: pass {number} in {time.perf_counter() - t0:.1f} s, threshold {tally.threshold}",
              file=sys.stderr)
    cache.close()
    return tallies, trajectory


def sweep(embedder: MemoEmbedder, originals: dict[str, str], lookups: list[Lookup], order: list[int]) -> list[str]:
    """Every static threshold at once on pass 1's lookups, the choices the learned threshold has: the cache runs
    at the lowest (the bound's floor), and a hit at similarity s is a hit at every threshold <= s (candidates are
    tried best first, so a higher threshold can only turn a hit into a miss)."""
    cache, scope = new_cache(embedder)
    for question, answer in originals.items():
        cache.store(scope, chat(question), answer)
    policy = TenantPolicy(similarity_threshold=SWEEP[0])
    found: list[tuple[float, bool] | None] = []
    for i in order:
        result = cache.lookup(scope, chat(lookups[i].case.query), policy=policy)
        found.append((result.similarity, result.response == lookups[i].answer) if isinstance(result, Hit) else None)
    cache.close()
    lines = ["| threshold | served | wrong of served | edits served | worst kind | paraphrase recall (reachable) "
             "| precision |", "|---|---|---|---|---|---|---|"]
    for t in SWEEP:
        tally = Tally()
        for i, hit in zip(order, found, strict=True):
            tally.count(lookups[i], hit[1] if hit is not None and hit[0] >= t else None)
        lines.append("| " + " | ".join([str(t), *served_cells(tally)[1:]]) + " |")
    return lines


def rate(n: int, d: int) -> str:
    return f"{pct(n, d)} ({n}/{d})"


def paraphrase_figures(t: Tally, kinds: tuple[str, ...] = SOURCES) -> tuple[str, str]:
    served, wrong = t.total(t.served, kinds), t.total(t.wrong, kinds)
    recall = rate(t.total(t.right_reachable, kinds), t.total(t.reachable, kinds))
    return recall, (f"{(served - wrong) / served:.3f}" if served else "n/a")


def worst_kind(t: Tally) -> tuple[str, float]:
    rates = {k: t.wrong[k] / t.lookups[k] for k in KINDS if t.lookups[k]}
    kind = max(rates, key=lambda k: rates[k], default="n/a")
    return kind, rates.get(kind, 0.0)


def served_cells(t: Tally) -> list[str]:
    """Lookups, served, wrong of served, edits served, worst kind, paraphrase recall and precision."""
    lookups, served, wrong = sum(t.lookups.values()), sum(t.served.values()), sum(t.wrong.values())
    kind, worst = worst_kind(t)
    return [str(lookups), pct(served, lookups), rate(wrong, served),
            rate(t.total(t.wrong, KINDS), t.total(t.lookups, KINDS)), f"{kind} {100 * worst:.1f}%",
            *paraphrase_figures(t)]


def summary_row(arm: str, label: str, t: Tally) -> str:
    cells = [arm, label, *served_cells(t), t.threshold, str(t.window_labels), str(t.near_labels),
             str(t.shadow_labels)]
    return "| " + " | ".join(cells) + " |"


def kind_row(arm: str, label: str, t: Tally) -> str:
    cells = [pct(t.wrong[k], t.lookups[k]) for k in KINDS] + [pct(t.total(t.wrong, KINDS), t.total(t.lookups, KINDS))]
    return f"| {arm} | {label} | " + " | ".join(cells) + " |"


def targets_row(arm: str, t: Tally) -> str:
    edits = t.total(t.lookups, KINDS)
    overall = t.total(t.wrong, KINDS) / edits if edits else 0.0
    over = [k for k in KINDS if t.lookups[k] and t.wrong[k] / t.lookups[k] > 0.02]
    reachable, served = t.total(t.reachable, SOURCES), t.total(t.served, SOURCES)
    recall = t.total(t.right_reachable, SOURCES) / reachable if reachable else 0.0
    precision = (served - t.total(t.wrong, SOURCES)) / served if served else 0.0
    g = SOURCES[1]
    gptcache = t.served[g] / t.lookups[g] if t.lookups[g] else 0.0
    met = {"false hits": overall <= 0.01 and not over, "recall": recall >= 0.6 and precision >= 0.97,
           "GPTCache": gptcache >= 0.85}
    return (f"| {arm} | {100 * overall:.2f}% | {', '.join(over) or 'none'} | {100 * recall:.1f}% | {precision:.3f} "
            f"| {rate(t.served[g], t.lookups[g])} | " + ", ".join(k for k, ok in met.items() if ok) + " |")


def report(results: dict[str, tuple[list[Tally], list[str]]], window: int) -> list[str]:
    later: dict[str, Tally] = {}
    for arm, (tallies, _) in results.items():
        later[arm] = Tally()
        for t in tallies[1:] or tallies:
            later[arm].add(t)
    span = "2-N" if len(next(iter(results.values()))[0]) > 1 else "1"
    lines = ["### Per pass", "",
             "| arm | pass | lookups | served | wrong of served | edits served | worst kind | paraphrase recall "
             "(reachable) | precision | threshold at end | labels in window | near-miss labels | shadow checks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, (tallies, _) in results.items():
        lines += [summary_row(arm, str(n), t) for n, t in enumerate(tallies, 1)]
        lines.append(summary_row(arm, span, later[arm]))
    lines += ["", "### Edits served, per kind (share of that kind's edit lookups)", "",
              "| arm | pass | " + " | ".join(KINDS) + " | all edits |", "|---|---|" + "---|" * (len(KINDS) + 1)]
    for arm, (tallies, _) in results.items():
        lines += [kind_row(arm, str(n), t) for n, t in enumerate(tallies, 1)]
        lines.append(kind_row(arm, span, later[arm]))
    lines += ["", f"### Paraphrases by source, passes {span}", "",
              "| arm | source | lookups | reachable | served | recall (reachable) | precision |",
              "|---|---|---|---|---|---|---|"]
    for arm, t in later.items():
        for source in SOURCES:
            recall, precision = paraphrase_figures(t, (source,))
            lines.append(f"| {arm} | {source.split(':')[1]} | {t.lookups[source]} | {t.reachable[source]} "
                         f"| {pct(t.served[source], t.lookups[source])} | {recall} | {precision} |")
    lines += ["", f"### Against the issue's targets, passes {span} ({TARGETS})", "",
              "| arm | edits served | kinds over 2% | paraphrase recall (reachable) | precision | GPTCache served "
              "| targets met |", "|---|---|---|---|---|---|---|"]
    lines += [targets_row(arm, t) for arm, t in later.items()]
    lines += ["", f"Learned threshold after every {window} lookups:", ""]
    lines += [f"- {arm}: {' '.join(trajectory)}" for arm, (_, trajectory) in results.items()
              if ARMS[arm].max_error_rate is not None]
    return lines


def false_hits(results: dict[str, tuple[list[Tally], list[str]]], arms: list[str], kinds: list[str]) -> list[str]:
    """The wrong hits each shown arm served, per kind asked for: the query, the original whose answer it got, and
    in how many of the passes (every pass sends each lookup once)."""
    if not kinds:
        return []
    lines = []
    for arm in arms:
        total = Tally()
        for t in results[arm][0]:
            total.add(t)
        for kind in kinds:
            pairs = total.wrong_pairs.get(kind, Counter())
            lines += ["", f"### Wrong hits served, {arm}, {kind}: {len(pairs)} distinct queries", ""]
            lines += [f"- {n}x: {query!r}  <-  {original!r}" for (query, original), n in sorted(pairs.items())]
    return lines


def cpu_model() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return found.group(1).strip() if found else platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return its markdown."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kind", type=int, default=400, help="edits per kind at most (some kinds have fewer)")
    parser.add_argument("--rule-paraphrases", type=int, default=400)
    parser.add_argument("--gptcache-pairs", type=int, default=None, help="held-out GPTCache pairs (default: all)")
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--edit-share", type=float, default=None,
                        help="edits' share of each pass, sampled anew each pass (default: every edit, about 2/3)")
    parser.add_argument("--window", type=int, default=500, help="lookups between two threshold readings")
    parser.add_argument("--seed", type=int, default=0, help="stream order and shadow-check draws")
    parser.add_argument("--vectors-cache", type=Path, default=None, help="reuse batch embeddings across runs")
    parser.add_argument("--show-false-hits", action="append", default=[], metavar="KIND", choices=[*KINDS, *SOURCES],
                        help="print the wrong hits served for this kind (repeatable), per arm of --show-arm")
    parser.add_argument("--show-arm", action="append", default=None, choices=list(ARMS),
                        help="the arm(s) whose wrong hits --show-false-hits prints (default: static + meaning)")
    parser.add_argument("--arm", action="append", default=None, choices=list(ARMS),
                        help="run only this arm (repeatable; default: every arm)")
    args = parser.parse_args(argv)
    offline_hub()
    t0 = time.perf_counter()
    cases = build(args.per_kind, args.rule_paraphrases)
    gptcache = [c for c in cases if c.kind == SOURCES[1]][:args.gptcache_pairs]
    cases = [c for c in cases if c.kind != SOURCES[1]] + gptcache
    originals = {o: f"answer {i}" for i, o in enumerate(dict.fromkeys(c.original for c in cases))}
    batch = Embedder(num_threads=2)
    vectors = embed_all(batch, [*originals, *(c.query for c in cases)], args.vectors_cache)
    print(f"{len(cases)} cases, {len(originals)} originals; embedded in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    lookups = oracle(cases, originals, vectors)
    paraphrases = [i for i, x in enumerate(lookups) if x.case.is_paraphrase]
    edits = [i for i, x in enumerate(lookups) if not x.case.is_paraphrase]
    share = args.edit_share
    wanted = len(edits) if share is None else min(len(edits), round(share / (1 - share) * len(paraphrases)))
    orders = []
    for number in range(args.passes):
        rng = random.Random(args.seed * 1000 + number)
        order = paraphrases + rng.sample(edits, wanted)
        rng.shuffle(order)
        orders.append(order)
    memo = MemoEmbedder(batch, vectors)
    swept = sweep(memo, originals, lookups, orders[0])
    shown_arms = [a for a in args.show_arm or ["static + meaning"] if args.arm is None or a in args.arm]
    results = {arm: run_arm(arm, policy, memo, originals, lookups, orders, args.seed, args.window,
                            frozenset(args.show_false_hits) if arm in shown_arms else frozenset())
               for arm, policy in ARMS.items() if args.arm is None or arm in args.arm}
    counts = Counter(c.kind for c in cases)
    head = [f"{len(orders[0])} held-out lookups per pass ({pct(len(orders[0]) - len(paraphrases), len(orders[0]))} "
            f"edits) x {args.passes} passes (reshuffled; nothing new stored), {len(originals)} originals in one "
            f"scope; cases {dict(counts)}; "
            f"{sum(x.reachable for x in lookups)} paraphrases reachable (cosine >= {REACHABLE}).",
            f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; embedder runtime "
            f"{batch.runtime}; seed {args.seed}; {time.perf_counter() - t0:.0f} s in all.", ""]
    sweep_head = ["### Any static threshold, pass 1 (hits at similarity >= t; guards on)", ""]
    text = "\n".join(head + sweep_head + swept + [""] + report(results, args.window)
                     + false_hits(results, shown_arms, args.show_false_hits))
    print(text)
    return text


if __name__ == "__main__":
    main()
