"""The known-answer questions: a fixed procedure (the same seed, the same questions), distinct questions of
every kind, and grading by rule that a reader would agree with."""

from __future__ import annotations

import pytest

from training.known_answers import CAPITALS, FACTS, KnownAnswerQuestion, is_correct, known_answer_questions


def test_the_same_seed_gives_the_same_questions_and_every_kind() -> None:
    qs = known_answer_questions(300, seed=0)
    assert [q.prompt for q in qs] == [q.prompt for q in known_answer_questions(300, seed=0)]
    assert [q.prompt for q in qs] != [q.prompt for q in known_answer_questions(300, seed=1)]
    assert len({q.prompt for q in qs}) == 300
    kinds = {k: sum(q.kind == k for q in qs) for k in ("add", "sub", "mul", "capital", "fact")}
    assert kinds["capital"] == len(CAPITALS) and kinds["fact"] == len(FACTS)
    assert min(kinds["add"], kinds["sub"], kinds["mul"]) > 50
    for q in qs:
        if q.kind == "add":
            a, b = q.operands
            assert q.prompt == f"What is {a} + {b}?" and q.answers == (str(a + b),)
        elif q.kind == "sub":
            a, b = q.operands
            assert a > b and q.answers == (str(a - b),)
    with pytest.raises(ValueError, match="distinct questions exist"):
        known_answer_questions(10_000)


@pytest.mark.parametrize(("answer", "right"), [
    ("7 + 5 = 12.", True), ("The sum of 7 and 5 is 12.", True), ("12", True), ("Twelve!", True),
    ("7 + 5 = 13", False), ("The answer is 1,2", True), ("I think it is 11, not 12", False), ("", False),
    ("7 and 5", False),
])
def test_number_answers(answer: str, right: bool) -> None:
    assert is_correct(KnownAnswerQuestion("What is 7 + 5?", ("12",), "add", (7, 5)), answer) is right


def test_an_answer_equal_to_an_operand_and_a_dash_that_is_no_minus() -> None:
    q = KnownAnswerQuestion("What is 10 - 5?", ("5",), "sub", (10, 5))
    assert is_correct(q, "10 - 5 = 5") and is_correct(q, "10-5=5") and is_correct(q, "5")
    assert not is_correct(q, "10 - 5 = 15")


def test_word_answers_are_whole_words_in_any_case() -> None:
    q = KnownAnswerQuestion("What is the capital of France?", ("Paris",), "capital")
    assert is_correct(q, "The capital of France is paris.") and not is_correct(q, "Lyon, not Parisian")
    china = KnownAnswerQuestion("What is the capital of China?", ("Beijing", "Peking"), "capital")
    assert is_correct(china, "Peking (now Beijing)") and is_correct(china, "It's Beijing")
    assert not is_correct(china, "Shanghai")
