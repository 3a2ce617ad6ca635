"""Tool calls for models whose chat template has no tool syntax (SmolLM2's): rendered into the prompt as text, and
the model's answer parsed back into OpenAI's `tool_calls`. Pure text and JSON, so the engine renders with it and
the gateway counts what the engine will render.

The syntax is Hermes's (Qwen's templates use it too):
- the functions go into the system message, one JSON object per line inside `<tools>…</tools>`, with the
  instruction to answer a call as `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
- an assistant message's earlier calls are rendered back as such blocks, and tool results as
  `<tool_response>…</tool_response>` in a user turn (consecutive results share one turn), since the template
  knows no `tool` role.

A message's `name` (OpenAI: a participant's name, so the model can tell participants of one role apart) goes into
its turn as the turn's `name`, where a chat template that knows names writes it. Many do not (SmolLM2's writes role
and content only): `named_roles` finds, once per template, the roles whose names it writes into the prompt, by
rendering a conversation with a marker name on each, and the engine refuses (400, param `messages.<i>.name`, code
`unsupported_parameter`) any name its template would not write, rather than serve a prompt in which alice and
mallory read the same (`unrendered_name`). A tool result's name is never written: its turn is a user turn of
results, where a name would read as a user's. An empty name names nobody and is taken as unset.

Answers come back two ways:
- free (`tool_choice` "auto"): `parse_answer` takes every well-formed block whose name is an offered function;
  a block that does not parse stays in the content, as text. With `parallel_tool_calls: false` it takes the first
  call only and ends the answer there: at OpenAI a call ends the assistant's turn and, parallel calls off, a turn
  holds at most one, so what the model wrote after its first call is no part of the answer (kept as content, it
  would hand the client a second call's syntax as prose);
- constrained ("required", a named function): `call_schema` is the JSON Schema the engine's grammar enforces,
  `{"name": <one of the functions>, "arguments": <its parameters>}`, and `parse_constrained` reads it. One call:
  `parallel_tool_calls` allows several calls, it does not ask for them, and a small model given a list keeps
  adding calls until max_tokens cuts the JSON (measured on SmolLM2-135M: a list of two functions' calls ran to 80
  tokens; one call closes in about 20). Free answers may make several, unless `parallel_tool_calls` is false.

A json_schema `response_format`'s `description` goes into the system message too (`format_line`), where the answer is
the JSON that format constrains: with tools offered it is not (a required or named call replaces the answer; free calls
and a format are refused by our engines), and the tools' text alone is rendered.

Parsing reads model output, which the request's max_tokens bounds; it is linear in it besides, since at most
MAX_BLOCKS_TRIED openings are tried.

Our markers (`RENDERED_MARKERS`) and the tenant's text share the turns' strings, and a tokenizer that has a marker as
an added token (Qwen's `<tool_call>`) reads it as that token in any of them: a tenant's `<tool_call>{...}</tool_call>`
in a message was a call in the history. In the turns, ours cannot be told from a tenant's, so `render_messages` (and
`turn`, `preamble`) take `escape`, applied to every tenant string (a message's text, its name, a call's JSON, a
result, the tools' JSON, a format's line) before our markers are written around it: wire/prompt_text.py's
`MarkerEscape` puts sentinels in place of the tenant's markers. Our markers are always a newline away from a tenant's
text, so none is made across the two.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from wire.chat_request import ChatCompletionRequest, ChatMessage, normalized_role
from wire.response_format import ResponseFormat
from wire.schema_costs import NAMED, VALUES
from wire.tools import Tool, must_call, offered_tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# what `render_messages` writes into the turns' strings itself, around the tenant's text (the preamble, calls, results)
RENDERED_MARKERS = frozenset({OPEN, CLOSE, "<tools>", "</tools>", "<tool_response>", "</tool_response>"})
Escape = Callable[[str], str]  # a tenant string as it goes into the turns (`MarkerEscape`)
MAX_BLOCKS_TRIED = 256  # `<tool_call>` openings parsed in one answer; the rest stay text
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
PREAMBLE = ("You may call {how_many} to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}}\n</tool_call>")
FORMAT_LINE = 'Your answer is JSON in the response format "{name}": {description}'  # a json_schema's description
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Call:
    """One call as the model made it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def openai(self, call_id: str | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry."""
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tools_preamble(tools: list[Tool], *, parallel: bool = True, escape: Escape | None = None) -> str:
    """The system-message text that offers `tools`: one call at most without `parallel` (the answer ends at its
    first call, `parse_answer`). `escape`: applied to the tools' JSON, the tenant's."""
    lines = [json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)},
                        ensure_ascii=False) for t in tools]
    return PREAMBLE.format(tools=(escape or _as_is)("\n".join(lines)), how_many="one or more functions" if parallel else
                           "at most one function")


def render_messages(req: ChatCompletionRequest, escape: Escape | None = None) -> list[dict[str, str]]:
    """The conversation as a chat template without tool syntax takes it: `{"role", "content"}` strings only, the
    offered tools in the system message, calls and results as text (consecutive results in one user turn, joined
    once: added one by one, each copied the turn so far, 0.35 s for 2,047 results in a 10 MB body). A turn of results
    holds them in the order of the calls they answer: the prompt holds no ids, so a result reads as the answer to the
    call at its place (results sent as their calls finished were each read as another call's); those that answer no
    call come after them, in the order sent (the engine refuses them: `stray_result`). `escape`: applied to each
    tenant string before our markers wrap it (none: as it is)."""
    messages: list[dict[str, str]] = []
    made: dict[str, int] = {}  # the last calls' ids, each at its place among them (its first, if made twice)
    for results, group in groupby(req.messages, key=lambda m: m.role == "tool"):
        if results:
            ordered = sorted(group, key=lambda m: made.get(m.tool_call_id or "", len(made)))
            messages.append({"role": "user", "content": "\n".join(turn(m, escape)["content"] for m in ordered)})
        else:
            said = list(group)
            messages.extend(turn(m, escape) for m in said)
            calls = said[-1].tool_calls or []
            made = {c.id: k for k, c in reversed(list(enumerate(calls)))}
    return with_preamble(messages, preamble(req, escape))


def stray_result(req: ChatCompletionRequest) -> int | None:
    """The index of the first tool result that answers no call of the assistant message its turn of results follows
    (an id that message did not make, one answered before, or results after a message that made no call), or None.
    The prompt holds no ids (`render_messages`), so such a result cannot be rendered as what it is: our engines
    refuse it, as OpenAI does, rather than hand it to the model as the answer to some other call."""
    pending: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.role != "tool":
            pending = {c.id for c in m.tool_calls or ()}  # only an assistant message has calls (wire's check)
        elif m.tool_call_id in pending:
            pending.discard(m.tool_call_id)
        else:
            return i
    return None


def turn(m: ChatMessage, escape: Escape | None = None) -> dict[str, str]:
    """One message as one template turn: a tool result as a user turn, an assistant's calls as blocks, a
    participant's `name` as the turn's (written where the template knows names; refused where not:
    `unrendered_name`). `escape`: applied to each of its strings before our markers wrap it."""
    escape = escape or _as_is
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{escape(m.text())}\n</tool_response>"}
    rendered = {"role": normalized_role(m.role), "content": _text_with_calls(m, escape)}
    if m.name:
        rendered["name"] = escape(m.name)
    return rendered


NAME_PROBE = "tiergate-name-probe-"  # + the role: a marker name no template writes unless it writes names
_PROBED_ROLES = ("system", "user", "assistant", "user")


def named_roles(render: Callable[[list[dict[str, str]]], str]) -> frozenset[str]:
    """The roles (as templates know them) whose `name` the chat template `render` writes into the prompt: a
    conversation of each role with a marker name, rendered once; a template that refuses it writes none."""
    probe = [{"role": r, "content": "Hello.", "name": NAME_PROBE + r} for r in _PROBED_ROLES]
    try:
        text = render(probe)
    except Exception:  # whatever a template raises, it wrote no name
        return frozenset()
    return frozenset(r for r in _PROBED_ROLES if NAME_PROBE + r in text)


def unrendered_name(req: ChatCompletionRequest, roles: frozenset[str]) -> int | None:
    """The index of the first message whose `name` a template writing names for `roles` only (`named_roles`) would
    leave out of the prompt, or None: a refusal names it rather than answer as if it had not been sent. A tool
    result's name is always left out (`turn`): "tool" is no role `named_roles` finds."""
    for i, m in enumerate(req.messages):
        if m.name and normalized_role(m.role) not in roles:
            return i
    return None


def preamble(req: ChatCompletionRequest, escape: Escape | None = None) -> str:
    """The system-message text that offers the request's tools, or else says what its JSON answer is for
    (`format_line`); "" when there is neither, so a request without them renders as it always has. `escape`: applied
    to the tenant's text in it (the tools' JSON; the format's line, which holds none of our markers)."""
    offered = offered_tools(req.tools, req.tool_choice)
    if offered:  # the answer is a call ("required", named), or free with tools, where our engines refuse a format
        return tools_preamble(offered, parallel=req.parallel_tool_calls is not False, escape=escape)
    return (escape or _as_is)(format_line(req.response_format))


def format_line(fmt: ResponseFormat | None) -> str:
    """What a json_schema answer is for, in the model's prompt: its `description` (OpenAI: "used by the model to
    determine how to respond in the format") with its `name`, as FORMAT_LINE. The grammar enforces only the schema,
    so without this line the description never reached the model. "" without a description (or a blank one): the
    name alone says little, and those prompts (and the answers cached for them) stay what they were."""
    spec = fmt.json_schema if fmt is not None and fmt.type == "json_schema" else None
    if spec is None or not spec.description or spec.description.isspace():
        return ""
    return FORMAT_LINE.format(name=spec.name, description=spec.description)


def with_preamble(turns: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """`turns` with `text` at the end of the system message (a new one first when there is none; its name kept)."""
    if not text:
        return turns
    if turns and turns[0]["role"] == "system":
        first = turns[0]["content"]
        return [{**turns[0], "content": f"{first}\n\n{text}" if first else text}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


def _text_with_calls(m: ChatMessage, escape: Escape) -> str:
    text = escape(m.text())
    if not m.tool_calls:
        return text
    blocks = []
    for call in m.tool_calls:
        try:
            block = json_text({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
        except (ValueError, RecursionError):  # not JSON, or too deep to write back: as the client sent it
            block = json_text({"name": call.function.name, "arguments": call.function.arguments})
        blocks.append(f"{OPEN}\n{escape(block)}\n{CLOSE}")  # the block's JSON is the tenant's, name and all
    return "\n".join([text, *blocks]) if text else "\n".join(blocks)


def parse_answer(text: str, names: set[str], *, parallel: bool = True) -> tuple[str, list[Call]]:
    """(content, calls) of a free answer: each `<tool_call>` block holding `{"name": <one of names>, "arguments":
    <object>}` becomes a call; the text around them, and any block that is not one, is the content. Without
    `parallel` (`parallel_tool_calls: false`) the answer ends at its first call: the text after it is dropped."""
    calls: list[Call] = []
    kept: list[str] = []
    at = 0  # text before `at` is consumed
    search = 0
    for _ in range(MAX_BLOCKS_TRIED):
        start = text.find(OPEN, search)
        if start < 0:
            break
        parsed = _block(text, start + len(OPEN), names)
        if parsed is None:
            search = start + len(OPEN)
            continue
        call, end = parsed
        kept.append(text[at:start])
        calls.append(call)
        at = search = end
        if not parallel:
            return "".join(kept).strip(), calls
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _block(text: str, pos: int, names: set[str]) -> tuple[Call, int] | None:
    """The call whose JSON starts after whitespace at `pos` and is followed by `</tool_call>`, and where the block
    ends; None when it is not one. The JSON decoder finds the object's end (nested braces, `</tool_call>` inside a
    string)."""
    pos = _skip_space(text, pos)
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    end = _skip_space(text, end)
    if not text.startswith(CLOSE, end):
        return None
    call = as_call(obj, names)
    return (call, end + len(CLOSE)) if call is not None else None


def as_call(obj: Any, names: set[str]) -> Call | None:
    """`{"name", "arguments"}` as a call of one of `names`, arguments re-serialised as JSON; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None  # a name that is a list or an object is no name (a set's `in` would raise TypeError)
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return Call(obj["name"], json_text(arguments))
    except ValueError:  # too deep to write back: no call
        return None


def json_text(obj: Any) -> str:
    """`obj` as JSON, non-ASCII characters as they are, except where its strings hold a lone UTF-16 surrogate (a
    model's or a client's `"\\ud800"` escape, which `json.loads` takes): then all escaped, as no UTF-8 encoder takes
    such a character (a response body that cannot be encoded was a 500; a prompt holding one, a tokenizer's
    TypeError).

    ValueError where `obj` is nested too deeply to write: `json.loads` reads JSON nested up to about the recursion
    limit, and `json.dumps`, called a few frames deeper, failed on what it had read with RecursionError (a 500: the
    engine's prompt of an earlier call's arguments, or a call the model wrote, nested 984 or 970 levels deep)."""
    try:
        text = json.dumps(obj, ensure_ascii=False)
    except RecursionError:
        raise ValueError("nested too deeply to write as JSON") from None
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj)
    return text


def _as_is(text: str) -> str:
    return text


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def call_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON Schema a constrained answer ("required", a named function) must match, or None when the answer
    is free: one call of one of the offered functions, its arguments valid against that function's parameters.
    A function's local `$ref`s (`#`, `#/$defs/x`: pydantic's and the OpenAI SDK's nested models) were written
    against its parameters' root; they are moved to where the parameters sit in the call schema (read against the
    call schema's root, `#/$defs/x` pointed at nothing and every required call of such a tool was a 400, and `#`
    meant the call object)."""
    if not must_call(req.tool_choice):
        return None
    offered = offered_tools(req.tools, req.tool_choice)
    at = ["#/properties/arguments"] if len(offered) == 1 else [f"#/anyOf/{i}/properties/arguments"
                                                               for i in range(len(offered))]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": _moved(t.function.parameters, base) if t.function.parameters is not None
                             else NO_PARAMETERS}}
             for t, base in zip(offered, at, strict=True)]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _moved(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local `$ref`s point where `schema` sits: at `base`, a JSON pointer fragment. Its
    nesting is bounded by wire's schema bounds."""
    if isinstance(schema, list):
        return [_moved(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = base + value[1:]
        elif key in NAMED and isinstance(value, dict):  # names, each to a subschema (whatever the name)
            moved[key] = {name: _moved(sub, base) for name, sub in value.items()}
        else:  # an instance (enum, const...) is copied as it is
            moved[key] = value if key in VALUES else _moved(value, base)
    return moved


def strict_calls(req: ChatCompletionRequest) -> bool:
    """Enforce the schema strictly (a keyword the grammar cannot enforce is refused) when a function asks to."""
    return any(t.function.strict for t in offered_tools(req.tools, req.tool_choice))


def parse_constrained(text: str, names: set[str], *, parallel: bool = True) -> list[Call] | None:
    """The calls of a constrained answer (one call, as `call_schema` has it; a list of them is read too, its first
    only without `parallel`), or None when it is not complete JSON (cut by max_tokens)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    calls = [as_call(o, names) for o in (obj if isinstance(obj, list) else [obj])]
    return [c for c in calls if c is not None][:None if parallel else 1] or None
