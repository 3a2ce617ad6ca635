"""Does the meaning check read questions better framed as statements? Training split only.

    .venv/bin/python -m bench.meaning_frames [--frames plain,asks,question,wants] [--edits 1200]

The check's model is an NLI cross-encoder (cache/meaning_check.py), and questions entail nothing. Each frame wraps
both questions of a pair, in both orders, before the model reads them; for each, the paraphrase recall left at the
calibration rule of bench/meaning_threshold.py (the smallest margin, rounded up to 0.05, that lets at most 1%, 2% or
5% of the training edits through). The data is that bench's: the project's near misses of training-split ShareGPT
questions and GPTCache's training-side pairs, never the held-out sets. Pairs too long to read whole are left out of
both shares. Session 38 chose a frame by this table and measured it once on the held-out sets (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import numpy as np

from bench.near_miss_sets import GPTCACHE, is_training_gptcache_origin, is_training_question
from bench.near_misses import build as build_near_misses
from cache.meaning_check import UNREAD, MeaningCheck

FRAMES: dict[str, Callable[[str], str]] = {
    "plain": lambda q: q,
    "asks": lambda q: f'Someone asks: "{q}"',
    "question": lambda q: f"The question is: {q}",
    "wants": lambda q: f"The user wants to know: {q}",
}
LET_THROUGH = (0.01, 0.02, 0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", default=",".join(FRAMES), help=f"which of {', '.join(FRAMES)}")
    ap.add_argument("--edits", type=int, default=1200, help="near misses generated before the split is applied")
    args = ap.parse_args()
    edits = [(c.original, c.edited) for c in build_near_misses(args.edits) if is_training_question(c.original)]
    paraphrases = [(p["origin"], p["similar"]) for p in json.loads(GPTCACHE.read_text())
                   if is_training_gptcache_origin(p["origin"])]
    check = MeaningCheck().load()
    print("| frame | " + " | ".join(f"let {t:.0%} through: margin, recall" for t in LET_THROUGH) + " |")
    print("|---|" + "---|" * len(LET_THROUGH))
    for name in args.frames.split(","):
        frame, t0 = FRAMES[name], time.perf_counter()
        em = np.array([check._pass(frame(a), frame(b)) for a, b in edits])
        pm = np.array([check._pass(frame(a), frame(b)) for a, b in paraphrases])
        em, pm = em[em != UNREAD], pm[pm != UNREAD]
        cells = []
        for share in LET_THROUGH:
            margin = math.ceil(float(np.quantile(em, 1 - share, method="higher")) / 0.05 - 1e-9) * 0.05
            cells.append(f"{margin:.2f}, {float((pm >= margin).mean()):.1%}")
        print(f"| {name} | " + " | ".join(cells) + f" |  ({len(em)} edits, {len(pm)} paraphrases read whole; "
              f"{time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
