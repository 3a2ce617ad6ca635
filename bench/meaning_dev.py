"""What the cache's defences do with the development set's pairs (bench/meaning_dev_sets.py), pair by pair.

    .venv/bin/python -m bench.meaning_dev [--out /tmp/meaning_dev.json] [--per-kind 300]

For each (original, query) pair: MiniLM's cosine (the cache's threshold is 0.8), the near-miss guards' verdict
(cache/guards.py `check`), and, for the pairs both let through, the meaning check's two entailment margins
(cached -> new and new -> cached; the check serves at min >= ACCEPT_MARGIN). Prints, per kind, how many pairs each
stage lets through, and writes every pair's figures as JSON for reading the failures. The pair is scored alone
(the cache's lookup may meet other candidates first); it is for diagnosis, not for the issue's figures, which
bench/cache_bound.py measures on the held-out sets.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from assets import offline_hub
from bench.meaning_dev_sets import build
from cache import Embedder
from cache.guards import check
from cache.meaning_check import ACCEPT_MARGIN, MeaningCheck

THRESHOLD = 0.8


def score(cases: list, nli: MeaningCheck) -> list[dict]:
    embedder = Embedder(num_threads=2)
    texts = list(dict.fromkeys([c.original for c in cases] + [c.query for c in cases]))
    vectors = dict(zip(texts, embedder.encode(texts, batch_size=64), strict=True))
    rows = []
    for c in cases:
        cosine = float(vectors[c.original] @ vectors[c.query])
        guard = check(c.query, c.original)
        row = {"kind": c.kind, "original": c.original, "query": c.query, "cosine": round(cosine, 4), "guard": guard}
        if cosine >= THRESHOLD and guard is None:
            forward, backward = _directions(nli, c.original, c.query)
            row |= {"forward": round(forward, 3), "backward": round(backward, 3)}
        rows.append(row)
    return rows


def _directions(nli: MeaningCheck, cached: str, new: str) -> tuple[float, float]:
    tokenizer, session = nli._tokenizer, nli._session
    a, b = tokenizer.encode_batch([(cached, new), (new, cached)])
    ids = np.array([a.ids, b.ids], dtype=np.int64)
    logits = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    margins = logits[:, 0] - logits[:, 1]
    return float(margins[0]), float(margins[1])


def summary(rows: list[dict], margin: float = ACCEPT_MARGIN) -> list[str]:
    lines = ["| kind | pairs | cosine >= 0.8 | and guards pass | and meaning accepts |", "|---|---|---|---|---|"]
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for kind in kinds:
        of = [r for r in rows if r["kind"] == kind]
        near = [r for r in of if r["cosine"] >= THRESHOLD]
        guarded = [r for r in near if r["guard"] is None]
        served = [r for r in guarded if min(r["forward"], r["backward"]) >= margin]
        lines.append(f"| {kind} | {len(of)} | {len(near)} | {len(guarded)} | {len(served)} "
                     f"({100 * len(served) / len(of):.1f}%) |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/meaning_dev.json"))
    ap.add_argument("--per-kind", type=int, default=300)
    args = ap.parse_args()
    offline_hub()
    t0 = time.perf_counter()
    nli = MeaningCheck().load()
    rows = score(build(args.per_kind), nli)
    args.out.write_text(json.dumps(rows, indent=1))
    print("\n".join(summary(rows)))
    print(f"{len(rows)} pairs in {time.perf_counter() - t0:.0f} s; guards' refusals: "
          f"{dict(Counter(r['guard'] for r in rows if r['guard']))}")


if __name__ == "__main__":
    main()
