"""The keys cover the request as the tier gets it: where each system message sits, every field of the last user
turn but its content, content parts as parts, line ends as sent. Each test here served one request another's answer
under key version k2."""

from __future__ import annotations

from typing import Any

from cache import Hit, SemanticCache, request_key
from cache.request_key import context_hash
from tests.cache.conftest import chat, scope

SYSTEM_FIRST = {"role": "system", "content": "Answer in English."}
SYSTEM_LATER = {"role": "system", "content": "From now on answer ONLY in German."}
EARLIER = [{"role": "user", "content": "Translate 'cat' to French."}, {"role": "assistant", "content": "chat"}]


def conversation(*messages: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {"model": "auto", "temperature": 0, "messages": list(messages), **params}


# -- F1: where a system message sits -----------------------------------------------------------------------------

def test_where_a_system_message_sits_is_in_the_exact_key_and_the_history() -> None:
    mid = conversation(SYSTEM_FIRST, *EARLIER, SYSTEM_LATER, {"role": "user", "content": "And 'dog'?"})
    first = conversation(SYSTEM_FIRST, SYSTEM_LATER, *EARLIER, {"role": "user", "content": "And 'dog'?"})
    assert context_hash(mid) == context_hash(first)  # the same system messages, in the same order
    a, b = request_key(mid), request_key(first)
    assert a.last_user_text == b.last_user_text == "And 'dog'?"
    assert a.exact_key != b.exact_key and a.history_hash != b.history_hash


def test_a_developer_message_after_the_last_user_turn_is_in_the_history() -> None:
    ask = {"role": "user", "content": "Summarize the thread."}
    after = conversation(SYSTEM_FIRST, ask, {"role": "developer", "content": "Reply in one word."})
    before = conversation(SYSTEM_FIRST, {"role": "developer", "content": "Reply in one word."}, ask)
    assert request_key(after).exact_key != request_key(before).exact_key
    assert request_key(after).history_hash != request_key(before).history_hash


# -- F8: every field of the last user turn but its content -------------------------------------------------------

def named(who: str) -> dict[str, Any]:
    return conversation({"role": "system", "content": "Group chat. Greet the speaker by their name."},
                        {"role": "user", "name": who, "content": "Hi, what is my name?"})


def test_the_last_user_turns_name_is_in_the_history() -> None:
    alice, bob = request_key(named("alice")), request_key(named("bob"))
    assert alice.last_user_text == bob.last_user_text == "Hi, what is my name?"
    assert alice.history_hash != bob.history_hash and alice.exact_key != bob.exact_key
    unnamed = named("x")
    del unnamed["messages"][-1]["name"]
    assert request_key(unnamed).history_hash not in (alice.history_hash, bob.history_hash)
    nulled = named("x")
    nulled["messages"][-1]["name"] = None  # a null is not set, as the wire models read it
    assert request_key(nulled) == request_key(unnamed)


def test_bob_never_gets_alices_answer(cache: SemanticCache) -> None:
    cache.store(scope(named("alice")), named("alice"), "Hi Alice!", {})
    assert isinstance(cache.lookup(scope(named("alice")), named("alice")), Hit)  # the repeat is served
    result = cache.lookup(scope(named("bob")), named("bob"))
    assert result.status == "miss" and result.reason == "no entry", result  # another partition: nothing compared


# -- F2: content parts as parts ----------------------------------------------------------------------------------

def parts(*texts: str) -> dict[str, Any]:
    return conversation({"role": "user", "content": [{"type": "text", "text": t} for t in texts]})


def test_content_parts_are_keyed_as_parts_not_a_joined_text() -> None:
    split = request_key(parts("Is 12", "3 prime?"))  # our engine reads "Is 123 prime?"
    for other in (conversation({"role": "user", "content": "Is 12\n3 prime?"}),  # k2's joined text
                  conversation({"role": "user", "content": "Is 123 prime?"}), parts("Is 123 prime?"),
                  parts("Is 1", "23 prime?"), parts("Is 12\n3 prime?")):
        assert request_key(other).exact_key != split.exact_key, other


def test_a_turn_of_several_parts_is_matched_exactly_only(cache: SemanticCache) -> None:
    """No one joined text is what every tier reads ("" by our engine, the parts as sent to a remote tier), so
    nothing is compared by meaning: the repeat is served, a text that joins alike is not."""
    assert request_key(parts("Is 12", "3 prime?")).last_user_text == ""
    stored = parts("Is 12", "3 prime?")
    cache.store(scope(stored), stored, "No: 123 = 3 x 41.", {})
    assert isinstance(cache.lookup(scope(stored), stored), Hit)
    for asked in (parts("Is 1", "23 prime?"), conversation({"role": "user", "content": "Is 123 prime?"})):
        result = cache.lookup(scope(asked), asked)
        assert result.status == "miss", (asked, result)


# -- F6: line ends as sent ---------------------------------------------------------------------------------------

def raw(prompt: str) -> dict[str, Any]:
    """A text completion as the pipeline carries it (gateway/pipeline/text_completion.py)."""
    return conversation({"role": "user", "content": prompt}, prompt_format="raw", max_tokens=16)


def test_crlf_is_not_lf_to_the_exact_key() -> None:
    assert request_key(raw("Line one\r\nLine two\r\n")).exact_key != request_key(raw("Line one\nLine two\n")).exact_key
    assert request_key(chat("Line one\r\nLine two")).exact_key != request_key(chat("Line one\nLine two")).exact_key
    crlf, lf = chat("q", system="Be brief.\r\nBe kind."), chat("q", system="Be brief.\nBe kind.")
    assert request_key(crlf).exact_key != request_key(lf).exact_key and context_hash(crlf) != context_hash(lf)


def test_a_raw_prompt_is_continued_as_sent_so_it_is_matched_exactly_only(cache: SemanticCache) -> None:
    """The embedding and the guards fold line ends and spaces, which change a raw prompt's continuation."""
    stored = raw("Line one\r\nLine two\r\n")
    assert request_key(stored).last_user_text == ""
    cache.store(scope(stored), stored, "Line three\r\n", {})
    assert isinstance(cache.lookup(scope(stored), stored), Hit)
    for asked in (raw("Line one\nLine two\n"), raw("Line one\r\nLine two\r\n "), raw("Line one\r\nLine two")):
        result = cache.lookup(scope(asked), asked)
        assert result.status == "miss", (asked, result)


def test_a_chat_turn_keeps_its_line_ends_to_the_guards_and_folds_them_only_for_the_embedding() -> None:
    crlf, lf = request_key(chat("First line\r\nsecond line")), request_key(chat("First line\nsecond line"))
    assert crlf.last_user_text == "First line\r\nsecond line"  # the guards read it as sent
    assert crlf.embedding_text == lf.embedding_text == "First line second line"
