"""What the cache's defences do with the development set's pairs (bench/meaning_dev_sets.py), pair by pair.

    .venv/bin/python -m bench.meaning_dev [--out /tmp/meaning_dev.json] [--reuse OLD.json] [--per-kind 300]

For each (original, query) pair: MiniLM's cosine (the cache's threshold is 0.8), the near-miss guards' verdict
(cache/guards.py `check`), and, for the pairs both let through, the meaning check's whole-pair entailment margins
(cached -> new and new -> cached; the check takes the smaller) and, for a minimal pair (cache/nli_span.py), the
margin of its changed place read with 1, 2 and 3 words of context. Prints, per kind, how many pairs each stage lets
through, with the whole reading alone (the check before session 46) and with the place's reading too (as served),
and the calibration of the place's margin (`SPAN_ACCEPT_MARGIN`), by a rule fixed before it was run: among the
minimal pairs the whole reading accepts, the score keeping 98% of the paraphrases, rounded down to 0.05; then the
context letting the fewest edits through. Then a rule fixed before it was run (session 46, GPTCache's
paraphrases): whether pairs that are not minimal pairs (read whole only, where GPTCache's refused paraphrases are)
could take a lower margin of their own, by ACCEPT_MARGIN's rule (bench/meaning_threshold.py) applied to them: the
lowest multiple of 0.05 letting at most 2% of the non-minimal edits through, scored by the check alone (such edits
are read whole whatever their cosine and guards); the last column serves read-whole pairs at that margin. Writes
every pair's figures as JSON for reading the failures
(`--reuse` takes the cosines and whole margins of an earlier JSON, so only the guards and the places are redone).

The pair is scored alone (the cache's lookup may meet other candidates first): it is for diagnosis and for choosing,
never for the issue's figures, which bench/cache_bound.py measures on the held-out sets.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np

from assets import offline_hub
from bench.meaning_dev_sets import build
from cache import Embedder
from cache.guards import check
from cache.meaning_check import ACCEPT_MARGIN, SPAN_ACCEPT_MARGIN, MeaningCheck
from cache.nli_span import minimal_pair

THRESHOLD = 0.8
CONTEXTS = (1, 2, 3)
KEEP = 0.98  # of the one-place paraphrases the whole reading accepts
LET_THROUGH = 0.02  # of the non-minimal edits, by the read-whole margin (as ACCEPT_MARGIN's rule)


def score(cases: list, nli: MeaningCheck, reuse: dict[tuple[str, str], dict]) -> list[dict]:
    todo = [c for c in cases if (c.original, c.query) not in reuse]
    vectors = {}
    if todo:
        texts = list(dict.fromkeys([c.original for c in todo] + [c.query for c in todo]))
        vectors = dict(zip(texts, Embedder(num_threads=2).encode(texts, batch_size=64), strict=True))
    rows = []
    for c in cases:
        old = reuse.get((c.original, c.query))
        cosine = old["cosine"] if old else round(float(vectors[c.original] @ vectors[c.query]), 4)
        row = {"kind": c.kind, "original": c.original, "query": c.query, "cosine": cosine,
               "guard": check(c.query, c.original)}
        row["minimal"] = minimal_pair(c.original, c.query) is not None
        # a non-minimal edit is read whatever its cosine and guards: the read-whole margin's rule counts them all
        if (cosine >= THRESHOLD and row["guard"] is None) or (not row["minimal"] and is_edit(row)):
            if old and "forward" in old:
                row |= {"forward": old["forward"], "backward": old["backward"]}
            else:
                forward, backward = _directions(nli, c.original, c.query)
                row |= {"forward": round(forward, 3), "backward": round(backward, 3)}
            for k in CONTEXTS:
                if (place := minimal_pair(c.original, c.query, k)) is not None:
                    row[f"place{k}"] = round(nli._margin(*place), 3)
        rows.append(row)
    return rows


def is_edit(row: dict) -> bool:
    return not row["kind"].startswith("paraphrase")


def _directions(nli: MeaningCheck, cached: str, new: str) -> tuple[float, float]:
    a, b = nli._tokenizer.encode_batch([(cached, new), (new, cached)])
    ids = np.array([a.ids, b.ids], dtype=np.int64)
    logits = nli._session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    margins = logits[:, 0] - logits[:, 1]
    return float(margins[0]), float(margins[1])


def accepted(row: dict, span_margin: float | None, context: int = 1, whole_only: float = ACCEPT_MARGIN) -> bool:
    """Served by the cache's defences: cosine, guards, the whole reading (at `whole_only` for a pair that is not a
    minimal pair, read whole only) and, unless `span_margin` is None, a minimal pair's place."""
    if row["cosine"] < THRESHOLD or row["guard"] is not None:
        return False
    if min(row["forward"], row["backward"]) < (ACCEPT_MARGIN if row["minimal"] else whole_only):
        return False
    return span_margin is None or row.get(f"place{context}", np.inf) >= span_margin


def whole_only_margin(rows: list[dict]) -> float:
    """The read-whole margin's rule, fixed before it was run (session 46): the lowest multiple of 0.05 at which at
    most 2% of the non-minimal edits are let through, scored by the check alone whatever their cosine and guards
    (ACCEPT_MARGIN's rule on the training split, bench/meaning_threshold.py)."""
    scores = [min(r["forward"], r["backward"]) for r in rows if is_edit(r) and not r["minimal"]]
    return math.ceil(float(np.quantile(scores, 1 - LET_THROUGH, method="higher")) / 0.05 - 1e-9) * 0.05


def summary(rows: list[dict], whole_only: float) -> list[str]:
    lines = ["| kind | pairs | cosine >= 0.8 | and guards pass | meaning, whole only | meaning, whole and place "
             f"| and read-whole pairs at {whole_only:.2f} |", "|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        of = [r for r in rows if r["kind"] == kind]
        near = [r for r in of if r["cosine"] >= THRESHOLD]
        guarded = [r for r in near if r["guard"] is None]
        whole = sum(accepted(r, None) for r in of)
        both = sum(accepted(r, SPAN_ACCEPT_MARGIN) for r in of)
        served = sum(accepted(r, SPAN_ACCEPT_MARGIN, whole_only=whole_only) for r in of)
        lines.append(f"| {kind} | {len(of)} | {len(near)} | {len(guarded)} | {whole} ({100 * whole / len(of):.1f}%) "
                     f"| {both} ({100 * both / len(of):.1f}%) | {served} ({100 * served / len(of):.1f}%) |")
    return lines


def calibrate(rows: list[dict]) -> list[str]:
    lines = ["| context words | margin (keeps 98% of one-place paraphrases) | paraphrases kept | edits let through |",
             "|---|---|---|---|"]
    for k in CONTEXTS:
        pairs = [r for r in rows if accepted(r, None) and f"place{k}" in r]
        para = [r[f"place{k}"] for r in pairs if r["kind"].startswith("paraphrase")]
        edits = [r[f"place{k}"] for r in pairs if not r["kind"].startswith("paraphrase")]
        margin = float(np.floor(np.quantile(para, 1 - KEEP, method="lower") / 0.05 + 1e-9) * 0.05)
        lines.append(f"| {k} | {margin:.2f} | {sum(p >= margin for p in para)} of {len(para)} "
                     f"| {sum(e >= margin for e in edits)} of {len(edits)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/meaning_dev.json"))
    ap.add_argument("--reuse", type=Path, default=None, help="an earlier --out: its cosines and whole margins")
    ap.add_argument("--per-kind", type=int, default=300)
    args = ap.parse_args()
    offline_hub()
    t0 = time.perf_counter()
    nli = MeaningCheck().load()
    reuse = {(r["original"], r["query"]): r for r in json.loads(args.reuse.read_text())} if args.reuse else {}
    rows = score(build(args.per_kind), nli, reuse)
    args.out.write_text(json.dumps(rows, indent=1))
    edits = [r for r in rows if is_edit(r) and not r["minimal"]]
    whole_only = whole_only_margin(rows)
    through = sum(min(r["forward"], r["backward"]) >= whole_only for r in edits)
    print(f"read-whole margin: {whole_only:.2f} ({through} of {len(edits)} non-minimal edits let through by the check "
          f"alone; their kinds: {dict(Counter(r['kind'] for r in edits))})")
    print("\n".join([*summary(rows, whole_only), "", *calibrate(rows)]))
    print(f"{len(rows)} pairs in {time.perf_counter() - t0:.0f} s; guards' refusals: "
          f"{dict(Counter(r['guard'] for r in rows if r['guard']))}")


if __name__ == "__main__":
    main()
