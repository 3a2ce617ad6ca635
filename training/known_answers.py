"""Questions with known answers that a 135M-parameter model can partly solve, so a cheaper tier's loss shows in
accuracy, not only in agreement with `full` (bench/router.py's second quality measure).

The procedure is fixed, so anyone regenerates the same questions from a seed:

- arithmetic: "What is A + B?" (A, B in 1..20), "What is A - B?" (20 >= A > B >= 1) and "What is A times B?"
  (A, B in 2..9), each kind shuffled by `numpy.random.default_rng(seed)` and taken in turn;
- capitals: "What is the capital of <country>?" for every country of `CAPITALS` (well-known ones);
- facts: every question of `FACTS`, each with one short answer (a number or a word).

Arithmetic fills what the two fixed tables leave (about three questions in four at n = 300); the order is
shuffled by the seed. A question is one user turn, asked like any ShareGPT prompt.

Grading is by rule, not by a model. A number answer is right when its first number equals the expected one,
after a restatement of the question's operands at its start (in either order) is skipped: "12", "7 + 5 = 12"
and "the sum of 5 and 7 is 12" are right, "7 + 5 = 13" and "7 and 5" are wrong. Number words up to ninety
count ("twelve").
A word answer is right when the answer contains it (or one of its accepted spellings) as a whole word.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

CAPITALS: dict[str, tuple[str, ...]] = {
    "France": ("Paris",), "Germany": ("Berlin",), "Italy": ("Rome",), "Spain": ("Madrid",),
    "Japan": ("Tokyo",), "China": ("Beijing", "Peking"), "Russia": ("Moscow",), "the United Kingdom": ("London",),
    "Egypt": ("Cairo",), "Greece": ("Athens",), "Portugal": ("Lisbon",), "Ireland": ("Dublin",),
    "Norway": ("Oslo",), "Sweden": ("Stockholm",), "Finland": ("Helsinki",), "Denmark": ("Copenhagen",),
    "Poland": ("Warsaw",), "Austria": ("Vienna",), "Hungary": ("Budapest",), "the Netherlands": ("Amsterdam",),
    "Belgium": ("Brussels",), "Canada": ("Ottawa",), "Australia": ("Canberra",), "Mexico": ("Mexico City",),
    "Brazil": ("Brasilia", "Brasília"), "Argentina": ("Buenos Aires",), "India": ("New Delhi", "Delhi"),
    "South Korea": ("Seoul",), "Thailand": ("Bangkok",), "Kenya": ("Nairobi",), "Peru": ("Lima",),
    "Turkey": ("Ankara",), "Iran": ("Tehran",), "Cuba": ("Havana",), "Chile": ("Santiago",),
    "Switzerland": ("Bern", "Berne"), "the Czech Republic": ("Prague",), "Vietnam": ("Hanoi",),
    "Indonesia": ("Jakarta",), "Philippines": ("Manila",),
}

FACTS: dict[str, tuple[str, ...]] = {
    "How many days are there in a week?": ("7",),
    "How many months are there in a year?": ("12",),
    "How many hours are there in a day?": ("24",),
    "How many minutes are there in an hour?": ("60",),
    "How many seconds are there in a minute?": ("60",),
    "How many legs does a spider have?": ("8",),
    "How many legs does an insect have?": ("6",),
    "How many sides does a triangle have?": ("3",),
    "How many sides does a hexagon have?": ("6",),
    "How many sides does an octagon have?": ("8",),
    "How many continents are there on Earth?": ("7",),
    "How many planets are there in our solar system?": ("8",),
    "How many days are there in a leap year?": ("366",),
    "At what temperature in degrees Celsius does water boil at sea level?": ("100",),
    "At what temperature in degrees Celsius does water freeze?": ("0",),
    "What is the largest planet in our solar system?": ("Jupiter",),
    "Which planet is known as the Red Planet?": ("Mars",),
    "Which planet is closest to the Sun?": ("Mercury",),
    "What is the largest ocean on Earth?": ("Pacific",),
    "Who wrote Romeo and Juliet?": ("Shakespeare",),
    "Who painted the Mona Lisa?": ("Leonardo", "da Vinci"),
    "What gas do plants absorb from the air for photosynthesis?": ("carbon dioxide", "CO2"),
    "What is the chemical symbol for gold?": ("Au",),
    "What is the chemical symbol for sodium?": ("Na",),
    "What is the chemical formula of water?": ("H2O", "H₂O"),
    "What is the tallest mountain in the world?": ("Everest",),
    "What is the longest river in Africa?": ("Nile",),
    "What is the hardest natural substance?": ("diamond",),
    "What is the main language spoken in Brazil?": ("Portuguese",),
    "What color do you get when you mix blue and yellow?": ("green",),
}

_NUMBER_WORDS = {w: i for i, w in enumerate((
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"))} | {
    "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
# unsigned: every expected answer is >= 0, and "8-2=6" must read 8, 2, 6
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?|\b(?:" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)
MAX_GRADED_CHARS = 2000  # an answer is short (tens of tokens); longer text is cut before the patterns run


@dataclass(frozen=True)
class KnownAnswerQuestion:
    prompt: str
    answers: tuple[str, ...]  # accepted answers: one number, or words
    kind: str  # add | sub | mul | capital | fact
    operands: tuple[int, ...] = ()  # numbers the question states, which an answer may repeat

    @property
    def numeric(self) -> bool:
        return self.answers[0].isdigit()


def known_answer_questions(n: int, *, seed: int = 0) -> list[KnownAnswerQuestion]:
    """`n` distinct questions: every capital and fact question (as many as fit), the rest arithmetic, taken in
    turn from the shuffled additions, subtractions and multiplications."""
    rng = np.random.default_rng(seed)
    fixed = [KnownAnswerQuestion(f"What is the capital of {c}?", a, "capital") for c, a in CAPITALS.items()]
    fixed += [KnownAnswerQuestion(q, a, "fact") for q, a in FACTS.items()]
    arithmetic = [
        [KnownAnswerQuestion(f"What is {a} + {b}?", (str(a + b),), "add", (a, b))
         for a in range(1, 21) for b in range(1, 21)],
        [KnownAnswerQuestion(f"What is {a} - {b}?", (str(a - b),), "sub", (a, b))
         for a in range(1, 21) for b in range(1, a)],
        [KnownAnswerQuestion(f"What is {a} times {b}?", (str(a * b),), "mul", (a, b))
         for a in range(2, 10) for b in range(2, 10)],
    ]
    if n > len(fixed) + sum(map(len, arithmetic)):
        raise ValueError(f"at most {len(fixed) + sum(map(len, arithmetic))} distinct questions exist, {n} were asked")
    picked = [fixed[i] for i in rng.permutation(len(fixed))[:n]]
    queues = [[kind[i] for i in rng.permutation(len(kind))] for kind in arithmetic]
    turn = 0
    while len(picked) < n:
        queue = queues[turn % len(queues)]
        if queue:
            picked.append(queue.pop())
        turn += 1
    return [picked[i] for i in rng.permutation(len(picked))]


def _numbers(text: str) -> list[float]:
    out = []
    for m in _NUMBER.finditer(text):
        token = m.group(0).lower()
        if token in _NUMBER_WORDS:
            out.append(float(_NUMBER_WORDS[token]))
        else:
            try:
                out.append(float(token.replace(",", "")))
            except ValueError:
                continue
    return out


def is_correct(question: KnownAnswerQuestion, answer: str) -> bool:
    """Whether `answer` gives the question's known answer (the rules are in the module docstring)."""
    text = answer[:MAX_GRADED_CHARS]
    if question.numeric:
        numbers = _numbers(text)
        k = len(question.operands)
        if k and sorted(numbers[:k]) == sorted(float(o) for o in question.operands):
            numbers = numbers[k:]  # "7 + 5 = 12", "the sum of 5 and 7 is 12": the question restated first
        return bool(numbers) and numbers[0] == float(question.answers[0])
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in question.answers)
