"""Near-miss guards: refuse a semantic hit whose last user turn differs in a detail embeddings blur.

Sentence embeddings put "convert 5 km to miles" and "convert 7 km to miles" at cosine 0.95+, and treat
"why is X" and "why is X not" as near twins. A semantic hit must mean the same question, so before one is
served the query and the candidate must agree on:

- numbers (digits, decimals, thousands separators, and number words: "five" == "5"),
- units (a canonical name per unit: "km" == "kilometres"), and the units a prompt sizes text in, where a count
  comes before them: "in 500 words" never answers "in 500 sentences", nor "5 bullet points" "5 paragraphs"
  (cache/size_units.py); and a unit swapped for another of its dimension, counted or not: a text that names a unit
  the other does not, where the other names one of the same dimension this one does not, asks for another quantity
  ("a list of words" / "a list of sentences", "in bullet points" / "in paragraphs"; the measurement units' long
  names are compared wherever they stand already),
- negations (how many: not, no, never, n't, without...),
- comparatives and superlatives (more/less, bigger/smaller, best/worst, any "<word>er than"),
- named entities (capitalized or mixed-case tokens not at a sentence start, acronyms, and a gazetteer of
  lower-case names such as programming languages); every entity of either side must occur in both,
- where a directional word is present (than, vs, from, into, convert...), the order of those anchors,
  so "is Paris bigger than London" never answers "is London bigger than Paris",
- the layout of a text of several lines: its line breaks and each line's indentation (blank lines and code
  fences aside), so a snippet whose `print(x)` moved out of its loop never answers the one where it is inside,
- and what it quotes, as sent: the text between double quotes (straight or curly), backticks, or single quotes
  that are not apostrophes, on one line. Each side's quotes must occur, character for character, in the other:
  `print("a  b")` never answers `print("a b")` (one line's spacing is otherwise prose, collapsed), nor
  `"abc".upper()` `"abd".upper()`.

The guards get the turns as sent and read them through `comparable`: NFKC (full-width, ligature and font variants
read as their plain letters and digits) with collapsed whitespace, except that superscripts, subscripts, vulgar
fractions and the like keep apart from their neighbours ("2³" reads "2^(3)", "10²" "10^(2)", "1⅛" "1(1⁄8)"), so the
numbers guard tells "Is 2³ prime?" from "Is 23 prime?" although the two embed identically (the embedding reads plain
NFKC, cache/request_key.py's `embedding_text`). The layout and the quotes are read from the text as sent
(cache/layout_quotes.py).

All of this is cheap regex and set work on the two texts (tens of microseconds); it is a heuristic that
errs on refusing: a refused paraphrase costs one model call, a wrong hit costs a wrong answer.

What a text reads as (`comparable`) and its features (`extract`) are remembered per owner: the tenant, and within
it the end user where its plan isolates them (`user`); cache/guard_memos.py says why and how far. A caller that names
no owner gets no memo: the work every time.

The texts are a tenant's, so the work is linear and bounded: the guards read at most `MAX_CHARS` characters
of a text, `check` refuses a text longer than that, as sent or as read (it cannot vouch for what it did not
read; NFKC and the marks can lengthen a text), and no pattern
backtracks over a run it has already scanned (possessive quantifiers, one scan per number). Numbers are
compared as canonical strings, never converted, so a 20,000-digit "number" costs what its length costs.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

from cache.guard_memos import GuardMemos
from cache.layout_quotes import layout, quotes_disagree
from cache.layout_quotes import quoted as quoted  # re-exported: callers and tests read guards.quoted
from cache.size_units import size_mentions, size_units

# The most of a text the guards read. The semantic cache serves by meaning only texts this short (and within the
# embedder's 256 word pieces), so the guards always see the whole of both texts they compare.
MAX_CHARS = 2048
TOO_LONG = "text too long to compare"
LAYOUT_DIFFERS = "layout differs"
QUOTES_DIFFER = "quoted text differs"

# Compatibility characters NFKC would run into their neighbours' digits: a run of superscripts or of subscripts is
# read as "^(...)" or "_(...)"; any other character whose NFKC form holds a digit, except full-width and font
# variants (which are digits as their neighbours are: "１２" is 12), as "(...)": ⅛ "(1⁄8)", ① "(1)", ⒈ "(1.)".
_RUN_MARKS = {"<super>": "^", "<sub>": "_"}
_PLAIN_DIGIT_TAGS = {"<wide>", "<font>", "<narrow>"}

_NUMBER_WORDS = {
    "zero": "0", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13", "fourteen": "14",
    "fifteen": "15", "sixteen": "16", "seventeen": "17", "eighteen": "18", "nineteen": "19", "twenty": "20",
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "hundreds": "100", "thousand": "1000", "thousands": "1000",
    "million": "1000000", "millions": "1000000", "billion": "1000000000", "dozen": "12",
    "half": "0.5", "twice": "2", "double": "2", "triple": "3", "third": "3", "fourth": "4",
    "fifth": "5", "sixth": "6", "seventh": "7", "eighth": "8", "ninth": "9", "tenth": "10",
}

# canonical unit -> spellings. Long names count anywhere; short symbols only right after a number.
_UNITS_LONG = {
    "km": "km kilometer kilometers kilometre kilometres", "m": "meter meters metre metres",
    "cm": "centimeter centimeters centimetre centimetres", "mm": "millimeter millimeters millimetre millimetres",
    "mile": "mile miles", "ft": "foot feet", "inch": "inch inches", "yard": "yard yards",
    "kg": "kilogram kilograms kilo kilos", "g": "gram grams", "mg": "milligram milligrams",
    "lb": "pound pounds lbs", "oz": "ounce ounces", "ton": "ton tons tonne tonnes",
    "l": "liter liters litre litres", "ml": "milliliter milliliters millilitre millilitres",
    "gal": "gallon gallons", "cup": "cup cups", "tsp": "teaspoon teaspoons", "tbsp": "tablespoon tablespoons",
    "c": "celsius centigrade", "f": "fahrenheit", "k": "kelvin", "s": "second seconds sec secs",
    "min": "minute minutes mins", "h": "hour hours hrs", "day": "day days", "week": "week weeks",
    "month": "month months", "year": "year years", "byte": "byte bytes", "kb": "kilobyte kilobytes",
    "mb": "megabyte megabytes", "gb": "gigabyte gigabytes", "tb": "terabyte terabytes", "bit": "bit bits",
    "%": "percent percentage", "usd": "dollar dollars usd", "eur": "euro euros eur", "gbp": "gbp sterling",
    "jpy": "yen jpy", "w": "watt watts", "kw": "kilowatt kilowatts", "kwh": "kwh", "v": "volt volts",
    "hz": "hertz hz", "ghz": "ghz gigahertz", "mph": "mph", "kmh": "kmh kph", "px": "pixel pixels px",
}
_UNITS_SHORT = {
    "km": "km", "m": "m", "cm": "cm", "mm": "mm", "mi": "mile", "ft": "ft", "in": "inch", "yd": "yard",
    "kg": "kg", "g": "g", "mg": "mg", "lb": "lb", "lbs": "lb", "oz": "oz", "t": "ton", "l": "l", "ml": "ml",
    "gal": "gal", "c": "c", "°c": "c", "f": "f", "°f": "f", "k": "k", "s": "s", "ms": "ms", "min": "min",
    "h": "h", "hr": "h", "kb": "kb", "mb": "mb", "gb": "gb", "tb": "tb", "%": "%", "w": "w", "kw": "kw",
    "v": "v", "hz": "hz", "ghz": "ghz", "x": "x",
}
_UNIT_WORD = {w: canon for canon, words in _UNITS_LONG.items() for w in words.split()}

_CURRENCY_SYMBOL = {"$": "usd", "€": "eur", "£": "gbp", "¥": "jpy"}

_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot",
              "nowhere", "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "cant", "wont",
              "shouldnt", "wouldnt", "couldnt", "hasnt", "havent", "hadnt", "mustnt", "neednt", "aint"}

# Comparatives and superlatives as (dimension, direction): "faster" and "slower" are one dimension, opposite.
_COMPARATIVE_PAIRS = [
    ("more", "less"), ("more", "fewer"), ("most", "least"), ("most", "fewest"), ("better", "worse"), ("best", "worst"),
    ("bigger", "smaller"), ("larger", "smaller"), ("greater", "smaller"), ("greater", "lesser"),
    ("biggest", "smallest"), ("largest", "smallest"), ("greatest", "smallest"), ("higher", "lower"),
    ("highest", "lowest"), ("faster", "slower"), ("fastest", "slowest"), ("cheaper", "costlier"),
    ("cheaper", "pricier"), ("cheapest", "priciest"), ("longer", "shorter"), ("longest", "shortest"),
    ("taller", "shorter"), ("tallest", "shortest"), ("older", "newer"), ("older", "younger"), ("oldest", "newest"),
    ("oldest", "youngest"), ("latest", "earliest"), ("later", "earlier"), ("hotter", "colder"), ("warmer", "cooler"),
    ("hottest", "coldest"), ("easier", "harder"), ("easiest", "hardest"), ("heavier", "lighter"),
    ("heaviest", "lightest"), ("stronger", "weaker"), ("strongest", "weakest"), ("closer", "farther"),
    ("closest", "farthest"), ("safer", "riskier"), ("safest", "riskiest"), ("richer", "poorer"), ("top", "bottom"),
    ("above", "below"), ("maximum", "minimum"), ("max", "min"), ("increase", "decrease"), ("before", "after"),
]
_COMPARATIVES: dict[str, set[tuple[str, int]]] = {}
for _up, _down in _COMPARATIVE_PAIRS:
    _COMPARATIVES.setdefault(_up, set()).add((_up, 1))
    _COMPARATIVES.setdefault(_down, set()).add((_up, -1))

_DIRECTIONAL = {"than", "vs", "versus", "compared", "compare", "convert", "converting", "into", "before", "after",
                "beat", "beats", "buy", "bought", "acquire", "acquired", "sell", "sold", "defeat",
                "defeated"}  # and "from ... to"; who did what to whom: the roles follow the order

# Lower-case names people type without capitals; sentence-initial capitals are not entities otherwise.
_GAZETTEER_TEXT = """
python java javascript typescript rust golang kotlin ruby php perl scala haskell elixir erlang clojure
c++ c# lua matlab fortran cobol sql mysql postgres postgresql sqlite mongodb redis kafka docker kubernetes
linux macos ios android ubuntu debian angular django nodejs numpy pandas pytorch tensorflow aws azure gcp
google microsoft facebook netflix tesla usa uk
china india japan germany france italy spain canada mexico brazil russia australia korea
london paris berlin tokyo beijing moscow rome madrid delhi mumbai sydney toronto chicago boston
"""
_GAZETTEER = frozenset(_GAZETTEER_TEXT.split())

_STOP_CAPS = {"i", "i'm", "i've", "i'd", "i'll", "ok", "okay", "hi", "hello", "please", "thanks", "the", "a", "an"}

# Possessive quantifiers (*+, ++) never give back what they matched: every pattern here is linear in its input.
_WORD = re.compile(r"[A-Za-z0-9][\w+#]*+(?:['’.\-][\w+#]++)*+|[$€£¥%°]")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d++(?:,\d{3})*+(?:\.\d++)?+|(?<![A-Za-z0-9_.])\.\d++")  # 是6m: a number
_HIDES_FIRST_DIGIT = frozenset(string.ascii_letters + "_")
_NUMBER_RUN = re.compile(r"\d++(?:[.,]\d++)*+")  # digits with single separators: 5, 1.5, 1,000.25, 1,2,3
_SYMBOL_AFTER = re.compile(r"\s?+(°?[A-Za-z]{1,4})\b|\s?+(%)")  # a unit right after a number: 5 km, 20%
_ER_THAN = re.compile(r"\b(\w+er)\s++than\b", re.IGNORECASE)
_FROM_TO = re.compile(r"\bfrom\s++\S++(?:\s++\S++){0,3}?\s++to\b")
_SPACES = re.compile(r"\s+")
_ACRONYM = re.compile(r"\b[A-Z]{2,5}\b")
_CAPITALIZED_RUN = re.compile(r"[A-Z][a-zA-Z]*+(?:[ \t]++[A-Z][a-zA-Z]*+)*+")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;\n]\s*|[\"“(]\s*)$")


@dataclass(frozen=True, slots=True)
class Features:
    """The guard-relevant details of one text."""

    numbers: tuple[str, ...]  # sorted, with repeats: "5 km and 5 miles" has two 5s
    units: tuple[str, ...]  # sorted canonical units, with repeats
    negations: int
    comparatives: frozenset[tuple[str, int]]  # (dimension, +1 or -1)
    entities: frozenset[str]  # lower-cased
    words: frozenset[str]  # every lower-cased word, to check that the other side's entities occur here
    compact: str  # lower-cased text without spaces: "Hugging Face" still contains "huggingface"
    acronyms: frozenset[str]  # all-capital words of 2-5 letters: ML, TS, NASA
    expansions: frozenset[tuple[str, str]]  # (initials, word) of capitalized runs: ("ML", "machine")
    anchors: tuple[str, ...]  # numbers, units and entities in order of appearance
    size_named: frozenset[str]  # the text-size units named anywhere, counted or not (cache/size_units.py)
    directional: bool
    # the expansions indexed both ways, so checking an entity is a lookup, not a scan
    initials: frozenset[str] = frozenset()  # {"ML"}
    initials_of: Mapping[str, frozenset[str]] = field(default_factory=dict, compare=False)  # {"machine": {"ML"}}


def _canon_number(raw: str) -> str:
    value = raw.replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".") or "0"
    return value.lstrip("0") or "0"


def _number_units(text: str) -> Iterator[tuple[str, int]]:
    """(symbol, offset) of each unit written right after a number: "5 km", "3.5GB", "20%".

    Each number is scanned once, then what follows it. A letter or "_" just before a number hides its first digit,
    so "x5km" has no unit and "ab12GB" has one (after the "2"); "%" needs no such start. (A single pattern for this
    tried every digit of a run as a start and rescanned the run from each: quadratic in its length.)
    """
    for run in _NUMBER_RUN.finditer(text):
        start, end = run.span()
        symbol = _SYMBOL_AFTER.match(text, end)
        if symbol is None:
            continue
        if symbol.group(2):
            yield "%", symbol.start(2)
        elif end - start > 1 or start == 0 or text[start - 1] not in _HIDES_FIRST_DIGIT:
            yield symbol.group(1), symbol.start(1)


def comparable(text: str, owner: Hashable = None, user: Hashable = None) -> str:
    """`text` as the guards compare it: NFKC and collapsed whitespace, with compatibility characters that would
    merge with neighbouring digits marked apart ("2³" -> "2^(3)", "H₂O" -> "H_(2)O", "1⅛" -> "1(1⁄8)").

    What reads longer than MAX_CHARS is cut to MAX_CHARS + 1 characters: every reader refuses such a text unread
    (`check`'s TOO_LONG, the meaning check's bound), and the texts are a tenant's. NFKC lengthens a character up to
    18 times (2,048 of U+FDFA read 36,847 characters, 76 KB), so the memo (cache/guard_memos.py) is held to what the
    guards read, not to what a caller hands them (the semantic cache hands them turns whose NFKC form fits MAX_CHARS).
    Remembered for `owner` (and its end user `user`): see the module."""
    if len(text) > MAX_CHARS:
        return text[:MAX_CHARS + 1]  # too long as sent: not remembered either
    return _MEMO.remembered(_MEMO.reads, _read, text, owner, user)


def _read(text: str) -> str:
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", _marked(text))
    return _SPACES.sub(" ", text).strip()[:MAX_CHARS + 1]


def _marked(text: str) -> str:
    out: list[str] = []
    run_mark, run = "", []  # the superscript or subscript run being read
    for ch in text:
        folded = unicodedata.normalize("NFKC", ch)
        tag = unicodedata.decomposition(ch).split(" ", 1)[0] if folded != ch else ""
        mark = _RUN_MARKS.get(tag, "")
        if mark != run_mark and run:
            out.append(f"{run_mark}({''.join(run)})")
            run = []
        run_mark = mark
        if mark:
            run.append(folded)
        elif folded != ch and tag not in _PLAIN_DIGIT_TAGS and any(c.isdigit() for c in folded):
            out.append(f"({folded})")
        else:
            out.append(ch)
    if run:
        out.append(f"{run_mark}({''.join(run)})")
    return "".join(out)


def extract(text: str, owner: Hashable = None, user: Hashable = None) -> Features:
    """The numbers, units, negations, comparatives, entities and anchors of `text`'s first MAX_CHARS characters,
    remembered for `owner` (and its end user `user`): see the module."""
    return _MEMO.remembered(_MEMO.features, _extract, text[:MAX_CHARS], owner, user)


def _extract(text: str) -> Features:
    numbers: list[str] = []
    units: list[str] = []
    entities: set[str] = set()
    comparatives: set[tuple[str, int]] = set()
    words: set[str] = set()
    anchors: dict[int, str] = {}  # start offset -> anchor; a unit seen as symbol and as word counts once
    negations = 0
    for m in _NUMBER.finditer(text):
        numbers.append(_canon_number(m.group()))
        anchors[m.start()] = numbers[-1]
    for symbol, where in _number_units(text):
        sym = symbol.lower()
        if sym in _UNITS_SHORT and sym not in _UNIT_WORD:  # "5 km": counted once, as a word
            units.append(_UNITS_SHORT[sym])
            anchors[where] = units[-1]
    for i, m in enumerate(_WORD.finditer(text)):
        token = m.group()
        low = token.lower().replace("’", "'")
        words.update((low, low.replace("'", "")))
        if i == 0 and low in ("no", "yes") and text[m.end():m.end() + 1] in (",", "."):
            continue  # "No, it doesn't exist" answers; the negation is in the rest
        if token in _CURRENCY_SYMBOL:
            units.append(_CURRENCY_SYMBOL[token])
            anchors[m.start()] = units[-1]
        found: dict[str, int] = {}  # part -> where it is first found in the token (one search per known word)
        for part in low.split("-") if "-" in low else (low,):  # "14-year-old", "2-minute"
            if part in _NUMBER_WORDS or part in _UNIT_WORD:
                if part not in found:
                    found[part] = m.start() + low.find(part)
                if part in _NUMBER_WORDS:
                    numbers.append(_NUMBER_WORDS[part])
                    anchors[found[part]] = numbers[-1]
                else:
                    units.append(_UNIT_WORD[part])
                    anchors[found[part]] = units[-1]
            comparatives.update(_COMPARATIVES.get(part, ()))
        if low.replace("'", "") in _NEGATIONS or low.endswith("n't"):
            negations += 1
        if _is_entity(token, low, text, m.start()):
            entities.add(low)
            anchors[m.start()] = low
    units.extend(size_units(text, _NUMBER_WORDS))
    for m in _ER_THAN.finditer(text):
        if m.group(1).lower() not in _COMPARATIVES:
            comparatives.add((m.group(1).lower(), 1))
    lowered = text.lower()
    directional = bool(words & _DIRECTIONAL) or _FROM_TO.search(lowered) is not None
    expansions = _expansions(text)
    initials_of: dict[str, set[str]] = {}
    for initials, word in expansions:
        initials_of.setdefault(word, set()).add(initials)
    return Features(tuple(sorted(numbers)), tuple(sorted(units)), negations, frozenset(comparatives),
                    frozenset(entities), frozenset(words), _SPACES.sub("", lowered),
                    frozenset(_ACRONYM.findall(text)), expansions,
                    tuple(anchors[k] for k in sorted(anchors)), size_mentions(text), directional,
                    frozenset(i for i, _ in expansions), {w: frozenset(i) for w, i in initials_of.items()})


def _expansions(text: str) -> frozenset[tuple[str, str]]:
    """(initials, word) for each run of capitalized words whose capitals spell 2-5 letters."""
    out: set[tuple[str, str]] = set()
    for m in _CAPITALIZED_RUN.finditer(text):
        initials = "".join(c for c in m.group() if c.isupper())
        if 2 <= len(initials) <= 5 and initials != m.group():
            out.update((initials, w.lower()) for w in m.group().split())
    return frozenset(out)


def _is_entity(token: str, low: str, text: str, start: int) -> bool:
    if low in _GAZETTEER:
        return True
    if low in _STOP_CAPS or token.isdigit() or len(token) < 2:
        return False
    if any(c.isdigit() for c in token) and any(c.isalpha() for c in token):  # ec2, win32, GPT-4, python3
        return True
    if any(c.isupper() for c in token[1:]) and any(c.isalpha() for c in token):  # PyTorch, NASA, iPhone
        return True
    if not token[0].isupper():
        return False
    return not _SENTENCE_START.search(text[max(0, start - 3):start])


def _mentions(f: Features, entity: str, other: Features) -> bool:
    """Whether text `f` mentions `entity` (an entity of `other`): as a word, inside its spaceless form, as the
    initials of its names ("ML" for "Machine Learning"), or as part of a name it abbreviates."""
    if entity in f.words or entity.replace(" ", "") in f.compact:
        return True
    if entity.upper() in f.initials:
        return True
    return not f.acronyms.isdisjoint(other.initials_of.get(entity, ()))


def _comparatives_disagree(a: frozenset[tuple[str, int]], b: frozenset[tuple[str, int]]) -> bool:
    """One side compares and the other does not, or both compare along one dimension in opposite directions.

    Paraphrases often swap one comparative for another ("latest" / "most recent"), so equal sets are
    not required; what changes the meaning is a comparison appearing, vanishing or turning round.
    """
    if bool(a) != bool(b):
        return True
    return any((dim, -sign) in b and (dim, sign) not in b for dim, sign in a) or \
        any((dim, -sign) in a and (dim, sign) not in a for dim, sign in b)


def check(query: str, candidate: str, *, owner: Hashable = None, user: Hashable = None) -> str | None:
    """None when `candidate` may answer `query` (both as sent); otherwise the reason for refusing, e.g. 'numbers
    differ'. `owner` (the tenant) and `user` (its end user, where its plan isolates them): whose memo of what the
    texts read as is read and filled (cache/guard_memos.py; None: no memo).

    A text longer than MAX_CHARS, as sent or as read (`comparable`), is refused (TOO_LONG): a detail past what the
    guards read could change its meaning.
    """
    if len(query) > MAX_CHARS or len(candidate) > MAX_CHARS:
        return TOO_LONG
    query_read, candidate_read = comparable(query, owner, user), comparable(candidate, owner, user)
    if len(query_read) > MAX_CHARS or len(candidate_read) > MAX_CHARS:
        return TOO_LONG
    q, c = extract(query_read, owner, user), extract(candidate_read, owner, user)
    if q.numbers != c.numbers:
        return "numbers differ"
    if q.units != c.units or _unit_swapped(q.size_named, c.size_named):
        return "units differ"
    if q.negations != c.negations:
        return "negation differs"
    if _comparatives_disagree(q.comparatives, c.comparatives):
        return "comparatives differ"
    for entity in q.entities | c.entities:
        if not (_mentions(q, entity, c) and _mentions(c, entity, q)):
            return "entities differ"
    if (q.directional or c.directional) and _shared_order(q.anchors, c.anchors):
        return "order of entities differs"
    if layout(query) != layout(candidate):
        return LAYOUT_DIFFERS
    if quotes_disagree(query, candidate):
        return QUOTES_DIFFER
    return None


def _unit_swapped(a: frozenset[str], b: frozenset[str]) -> bool:
    """Each side names a unit of one dimension (here the text-size units, all one dimension) that the other does
    not: one unit was put in another's place. A unit named on one side only, with nothing in its place ("in other
    words, ..." / "..."), is not a swap: it changes no quantity unless counted, which `units` compares."""
    return bool(a - b) and bool(b - a)


def _shared_order(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """True when the anchors that occur once on both sides come in a different order."""
    count_a, count_b = Counter(a), Counter(b)
    shared = {x for x, n in count_a.items() if n == 1 and count_b.get(x) == 1}
    return [x for x in a if x in shared] != [x for x in b if x in shared]


_MEMO: GuardMemos[Features] = GuardMemos()
