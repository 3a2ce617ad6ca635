"""Near-miss guards: meaning-changing edits are refused, paraphrases pass."""

from __future__ import annotations

import pytest

from cache.guards import check, extract


@pytest.mark.parametrize(("query", "candidate", "reason"), [
    ("Convert 5 km to miles", "Convert 7 km to miles", "numbers differ"),
    ("Round 3.14 to one decimal", "Round 3.15 to one decimal", "numbers differ"),
    ("What is 1,000 times 3?", "What is 1,001 times 3?", "numbers differ"),
    ("Give me five ideas", "Give me six ideas", "numbers differ"),
    ("Convert 5 km to miles", "Convert 5 kg to miles", "units differ"),
    ("How long is 10 minutes in seconds?", "How long is 10 hours in seconds?", "units differ"),
    ("Why is the sky blue?", "Why is the sky not blue?", "negation differs"),
    ("Can I eat eggs with milk?", "Can I eat eggs without milk?", "negation differs"),
    ("Which uses more memory, lists or tuples?", "Which uses less memory, lists or tuples?", "comparatives differ"),
    ("Is a cat bigger than a dog?", "Is a cat smaller than a dog?", "comparatives differ"),
    ("What is the population of France?", "What is the population of Germany?", "entities differ"),
    ("Summarize the history of Microsoft", "Summarize the history of Apple", "entities differ"),
    ("Write a sort function in python", "Write a sort function in rust", "entities differ"),
    ("Is Paris bigger than London?", "Is London bigger than Paris?", "order of entities differs"),
    ("Convert 5 km to miles", "Convert 5 miles to km", "order of entities differs"),
    ("Games for a 14-year old girl", "Games for a 14-month old girl", "units differ"),
    ("Spend $20 each month; what is left by the month of April next year?",
     "Spend $20 each year; what is left by the month of April next year?", "units differ"),  # counts, not sets
    ("How do I launch an ec2 instance?", "How do I launch an ec3 instance?", "entities differ"),
    ("直径是6m的圆形", "直径是8m的圆形", "numbers differ"),
    ("List the top 10 attractions in Fiji", "List the bottom 10 attractions in Fiji", "comparatives differ"),
    ("Which sorting algorithm is fastest?", "Which sorting algorithm is used?", "comparatives differ"),
])
def test_near_misses_are_refused(query: str, candidate: str, reason: str) -> None:
    assert check(query, candidate) == reason
    assert check(candidate, query) == reason  # symmetric


@pytest.mark.parametrize(("query", "candidate"), [
    ("Convert 5 km to miles", "convert five kilometres to miles"),
    ("Why isn't the sky blue?", "Why is the sky not blue?"),
    ("What is the capital of France?", "Tell me the capital city of France."),
    ("Diffusers are state-of-the-art diffusion models in PyTorch.", "PyTorch has cutting-edge diffusers."),
    ("How do I reverse a list?", "What's the way to reverse a list?"),
    ("Explain how TCP works", "TCP: explain how it works"),  # an entity at a sentence start still counts
    ("No, LOAD_HU doesn't exist in v2.10.0.", "LOAD_HU is not a feature of v2.10.0."),  # an answer's "No,"
    ("Tools for ML tasks, with TS types", "Tools for Machine Learning tasks, with TypeScript types"),
    ("Huggingface.js is a set of libraries", "Hugging Face.js is a collection of libraries"),
    ("What is the latest release?", "What is the most recent release?"),
])
def test_paraphrases_pass(query: str, candidate: str) -> None:
    assert check(query, candidate) is None


def test_features() -> None:
    f = extract("Is it 1,500.50 USD or 20% more in Berlin than in Tokyo? I don't know.")
    assert f.numbers == ("1500.5", "20")
    assert f.units == ("%", "usd")
    assert f.negations == 1
    assert ("more", 1) in f.comparatives
    assert {"berlin", "tokyo"} <= f.entities and "i" not in f.entities
    assert f.directional
