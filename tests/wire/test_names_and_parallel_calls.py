"""wire/tool_calls.py: a message's `name` goes into its template turn (and `named_roles` / `unrendered_name` tell which
names a template would leave out), and `parallel_tool_calls: false` leaves at most one call in an answer."""

from __future__ import annotations

from typing import Any

from wire.chat_request import ChatCompletionRequest
from wire.tool_calls import NAME_PROBE, named_roles, parse_answer, parse_constrained, render_messages, unrendered_name

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]


def chat(messages: list[dict[str, Any]], **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def test_names_go_into_their_turns_and_requests_that_differ_by_name_render_apart() -> None:
    alice, mallory = (render_messages(chat([{"role": "user", "name": n, "content": "Who am I?"}]))
                      for n in ("alice", "mallory"))
    assert alice == [{"role": "user", "name": "alice", "content": "Who am I?"}] and alice != mallory
    turns = render_messages(chat([
        {"role": "developer", "name": "ops", "content": "Be brief."}, {"role": "user", "name": "", "content": "Hi"},
        {"role": "assistant", "name": "bot", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "f", "tool_call_id": "call_1", "content": "done"}], tools=TOOLS))
    assert [t.get("name") for t in turns] == ["ops", None, "bot", None]  # empty: nobody; a result's turn: none
    assert turns[0]["role"] == "system" and turns[3]["role"] == "user"


def test_which_names_a_template_writes_and_which_would_be_left_out() -> None:
    def user_names_only(turns: list[dict[str, str]]) -> str:
        return "".join(f"<{t['role']}{' ' + t['name'] if t['role'] == 'user' else ''}>{t['content']}" for t in turns)

    def no_names(turns: list[dict[str, str]]) -> str:
        return "".join(f"<{t['role']}>{t['content']}" for t in turns)

    def refuses(turns: list[dict[str, str]]) -> str:
        raise ValueError("roles must alternate")

    assert named_roles(user_names_only) == frozenset({"user"}) and NAME_PROBE + "user" in user_names_only(
        [{"role": "user", "name": NAME_PROBE + "user", "content": ""}])
    assert named_roles(no_names) == frozenset() and named_roles(refuses) == frozenset()
    req = chat([{"role": "system", "content": "Be brief."}, {"role": "user", "name": "alice", "content": "Hi"},
                {"role": "assistant", "name": "bot", "content": "Hello"}])
    assert unrendered_name(req, frozenset()) == 1
    assert unrendered_name(req, frozenset({"user"})) == 2
    assert unrendered_name(req, frozenset({"user", "assistant"})) is None
    developer = chat([{"role": "developer", "name": "ops", "content": "Be brief."}])
    assert unrendered_name(developer, frozenset({"system"})) is None  # a developer message is a system turn
    tool = chat([{"role": "tool", "name": "f", "tool_call_id": "call_1", "content": "done"}])
    assert unrendered_name(tool, frozenset({"system", "user", "assistant"})) == 0
    assert unrendered_name(chat([{"role": "user", "name": "", "content": "Hi"}]), frozenset()) is None


def test_without_parallel_calls_an_answer_has_its_first_call_and_ends_there() -> None:
    names = {"f", "g"}
    block = '<tool_call>{{"name": "{}", "arguments": {{}}}}</tool_call>'
    text = f"Let me. {block.format('x')} {block.format('f')} then {block.format('g')} and more"
    content, calls = parse_answer(text, names)
    assert [c.name for c in calls] == ["f", "g"] and content.endswith("then  and more")
    content, calls = parse_answer(text, names, parallel=False)
    assert [c.name for c in calls] == ["f"] and content == f"Let me. {block.format('x')}"
    assert parse_answer("no call", names, parallel=False) == ("no call", [])
    both = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
    assert [c.name for c in parse_constrained(both, names) or []] == ["f", "g"]
    assert [c.name for c in parse_constrained(both, names, parallel=False) or []] == ["f"]


def test_the_tools_prompt_offers_one_call_only_without_parallel_calls() -> None:
    """The model is told what the answer will keep: at most one call under `parallel_tool_calls: false`."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    user = [{"role": "user", "content": "hi"}]
    single = render_messages(chat(user, tools=tools, parallel_tool_calls=False))[0]["content"]
    several = render_messages(chat(user, tools=tools))[0]["content"]
    assert single.startswith("You may call at most one function") and "one or more" not in single
    assert several.startswith("You may call one or more functions")
    assert several == render_messages(chat(user, tools=tools, parallel_tool_calls=True))[0]["content"]
