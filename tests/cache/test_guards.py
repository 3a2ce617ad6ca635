"""Near-miss guards: meaning-changing edits are refused, paraphrases pass, and hostile text costs linear work."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cache import guards
from cache.guards import MAX_CHARS, TOO_LONG, check, extract
from tests.text_reads import TextReads, best_cpu_time


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


@pytest.mark.parametrize(("query", "candidate"), [
    ("Summarize this article in 100 words", "Summarize this article in 100 sentences"),
    ("Explain quantum computing in 3 paragraphs", "Explain quantum computing in 3 pages"),
    ("Write an essay of 500 words on climate change", "Write an essay of 500 pages on climate change"),
    ("List the key ideas in five bullet points", "List the key ideas in five short paragraphs"),
    ("Write a tweet of at most 280 characters about AI", "Write a tweet of at most 280 words about AI"),
    ("Explain recursion in one sentence", "Explain recursion in one line"),
    ("How many tokens are in this prompt?", "How many words are in this prompt?"),
    ("What is the token limit of the API?", "What is the character limit of the API?"),
])
def test_text_size_units_are_compared(query: str, candidate: str) -> None:
    """The units a prompt sizes text in: the same count of other units asks for another answer."""
    assert check(query, candidate) == "units differ"
    assert check(candidate, query) == "units differ"


@pytest.mark.parametrize(("query", "candidate"), [
    ("Write about 300 words on sleep", "Write roughly 300 words about sleep"),
    ("Summarize it in 3 short paragraphs", "Summarize it in three paragraphs"),
    ("Give me 5 bullet points on sleep", "Give me five points on sleep"),
    ("What is a word for happy?", "What's another term for happy?"),  # not a size: no count before it
    ("In other words, what does it do?", "Put simply, what does it do?"),
    ("How do I open a page in a new tab?", "How can I open a link in a new tab?"),
    ("Which one of these lines is wrong?", "Which of these is wrong?"),  # "one of": a part, not a size
])
def test_text_size_words_without_a_count_are_not_units(query: str, candidate: str) -> None:
    assert check(query, candidate) is None


@pytest.mark.parametrize(("query", "candidate"), [
    ("Rewrite this text in simpler words", "Rewrite this text in simpler sentences"),
    ("Summarize each chapter of the book", "Summarize each page of the book"),
    ("Make a list of the lines that rhyme", "Make a list of the verses that rhyme"),
    ("Split the prompt into tokens", "Split the prompt into characters"),
])
def test_a_text_size_unit_swapped_for_another_is_refused_without_a_count(query: str, candidate: str) -> None:
    """Uncounted, a unit put in another's place still asks for another size of text (issue 21: the meaning check
    served such swaps)."""
    assert check(query, candidate) == "units differ"
    assert check(candidate, query) == "units differ"


@pytest.mark.parametrize(("query", "candidate"), [
    ("Explain the point of this paragraph", "Explain the purpose of this paragraph"),  # nothing in its place
    ("In other words, what does this section say?", "Put simply, what does this section say?"),
    ("Translate these sentences, word by word", "Translate these sentences word for word"),
])
def test_a_text_size_unit_named_on_one_side_only_is_no_swap(query: str, candidate: str) -> None:
    assert check(query, candidate) is None


def test_features() -> None:
    f = extract("Is it 1,500.50 USD or 20% more in Berlin than in Tokyo? I don't know.")
    assert f.numbers == ("1500.5", "20")
    assert f.units == ("%", "usd")
    assert f.negations == 1
    assert ("more", 1) in f.comparatives
    assert {"berlin", "tokyo"} <= f.entities and "i" not in f.entities
    assert f.directional


@pytest.mark.parametrize(("text", "units"), [
    ("ab12GB", ("gb",)), ("v2.5GB", ("gb",)), ("costs 20 %", ("%",)), ("x5%", ("%",)), ("1,000 kg", ("kg",)),
    ("3.5 GB and 2 TB", ("gb", "tb")), ("5°C", ("c",)), ("1,2,3,4 km", ("km",)), ("x5km", ()),
])
def test_units_written_after_numbers(text: str, units: tuple[str, ...]) -> None:
    assert extract(text).units == units


def test_numbers_longer_than_any_quantity_compare_as_strings() -> None:
    big = "9" * 40
    assert extract(f"{big} apples").numbers == (big,)
    assert check(f"Is {big} prime?", f"Is {big[:-1]}8 prime?") == "numbers differ"
    assert check(f"Is {big} prime?", f"Is {big} a prime?") is None


def test_texts_longer_than_the_window_are_refused_not_half_read() -> None:
    cached = "1" * 150
    assert check(cached, cached) is None
    assert check(cached, "1" * 20_000) == TOO_LONG
    assert check("1" * 20_000, cached) == TOO_LONG
    head = "Convert 5 km to miles. " + "x" * (MAX_CHARS - 25)
    assert len(head) == MAX_CHARS - 2 and check(head, head) is None  # a text within the window is read whole
    assert check(head + " Not!", head) == TOO_LONG  # the negation is past the window: the guards cannot tell


ADVERSARIAL: dict[str, Callable[[int], str]] = {
    "digits": lambda n: "1" * n,
    "digits after a letter": lambda n: "x" + "1" * n,
    "digits with separators": lambda n: ",".join("1" * (n // 2)),
    "decimal points": lambda n: ".".join("1" * (n // 2)),
    "one word": lambda n: "a" * n,
    "er er er": lambda n: "er" * (n // 2) + " than",
    "capitalized words": lambda n: "Abc " * (n // 4),
    "from a from a ... to": lambda n: "from a " * (n // 7) + "to",
    "hyphenated number and unit words": lambda n: "-".join(["km", "five", "miles", "ten"] * (n // 16)),
    "blanks": lambda n: " " * n + "x",
    "mixed": lambda n: "12 km ,3 Paris ML from 5 " * (n // 25),
    "quotes never closed": lambda n: '"a `b \'c “d ' * (n // 12),
    "empty quotes": lambda n: '""\'\'``' * (n // 6),
    "counts before text-size words": lambda n: "how many number of 5 short words count " * (n // 39),
}


@pytest.mark.parametrize("make", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_extraction_is_linear_even_without_the_window(make: Callable[[int], str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The window bounds the cost; the scan itself must not be what is quadratic (ten times the text, about ten
    times the work; a quadratic pattern takes a hundred times, and seconds)."""
    monkeypatch.setattr(guards, "MAX_CHARS", 10**9)
    for scan in (extract, guards.quoted):
        small, large = (best_cpu_time(scan, make(n)) for n in (20_000, 200_000))  # no owner: no memo
        assert large < 30 * small + 0.01, (scan.__name__, small, large)


@pytest.mark.parametrize("make", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_four_megabytes_are_read_no_further_than_the_window(make: Callable[[int], str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's 4 MB text costs what the window costs: no scan of the guards (their functions, their patterns,
    the helpers of cache/layout_quotes.py and cache/size_units.py they call) is handed more than MAX_CHARS of it.
    What that costs in time is the bench's to say (bench/hostile_tenant.py's regex bait); here it is counted."""
    text = make(4_000_000)
    window = extract(text[:MAX_CHARS])
    reads = TextReads.watch(monkeypatch, guards, unwatched=("check", "extract"))
    assert extract(text) == window  # the first MAX_CHARS characters, read whole
    assert check(text, "1" * 150) == TOO_LONG
    assert check("1" * 150, text) == TOO_LONG
    assert 0 < reads.longest <= MAX_CHARS, reads.by
