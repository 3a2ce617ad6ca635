"""From an OpenAI chat request to cache keys, and whether the request may use the cache at all.

Three things come out of a request body:
- `context_hash`: the system prompt(s), tools and every parameter that shapes the output (max_tokens,
  stop, response_format...). It is part of the scope, so neither layer ever matches across it.
- `exact_key`: a hash of every message as sent, in order, with every field of each (role, name, content, tool
  calls...): system and developer messages where they were sent (a tier renders them there), content parts as a
  list of parts (a remote tier gets the parts, not a joined text). Two requests with the same exact key in the
  same scope are the same question.
- `semantic_key`: what the semantic layer compares. The rest of the conversation (the history: every message
  but the last user turn, and every field of that turn but its content) must match exactly, through
  `history_hash`, which selects the faiss partition; the last user turn's text is embedded and compared by
  meaning. A follow-up such as "and in Celsius?" means something only in its history, and embeddings do not
  see small edits in long histories, so the history is never matched approximately.

Every hash reads the messages exactly as sent, line ends included: a tier gets the bytes as sent, and a raw
completion's CRLF line ends or trailing space change its continuation. Unicode compatibility forms and whitespace
carry meaning too ("2³" is not "23", "10²" not "102", an indented `print(x)` runs in its loop and an unindented one
after it), so a request that differs in them is another question to the exact layer. Only the embedding of the
last user turn reads a normalized text (`embedding_text`), so that width and spacing variants still land near each
other; the near-miss guards then read both turns as sent (cache/guards.py). The semantic layer compares only a
last user turn whose content is one text that every tier reads alike (`compared_text`): a string, or a single
text part. A turn of several parts (our engine joins them with "", a remote tier gets the parts and may join them
otherwise) and a raw completion's prompt (continued character for character; the embedding and the guards fold
whitespace) are matched exactly only. `KEY_VERSION` is in every hash: entries stored under an older way of keying
are unreachable (a miss), never served to a request they did not answer.

`decide()` says whether a request may be looked up and stored, with the reason, e.g. `bypass: temperature>0`.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from cache.guards import MAX_CHARS
from wire.chat_request import SYSTEM_ROLES

# In every hash below. Bump it whenever what a hash reads changes: every scope id, exact key and partition changes
# with it, so no entry keyed the old way is ever found by a request keyed the new way. "k3": every message in
# order with all its fields (k2 left out where system messages sat and the last user turn's name, so the answer for
# alice, or to a conversation whose system message came later, was served to bob or to the reordered one), content
# parts as parts (k2 joined them with "\n": ["Is 12", "3 prime?"] had the key of "Is 12\n3 prime?"), line ends as
# sent (k2 made CRLF LF). "k2": the texts as sent (k1, unversioned, hashed NFKC with collapsed whitespace and served
# "Is 23 prime?" the answer to "Is 2³ prime?"). Not bumped when a seeded sample's sampling class took a new form
# (sampling_class): only seeded scopes moved, and the new form equals no old one.
KEY_VERSION = "k3"

# Request fields that change what the model answers (besides messages and sampling); part of the scope.
OUTPUT_PARAMS = ("max_tokens", "max_completion_tokens", "stop", "response_format", "logit_bias", "logprobs",
                 "top_logprobs", "n", "presence_penalty", "frequency_penalty", "tool_choice",
                 "parallel_tool_calls", "reasoning_effort", "seed_offset",
                 "prompt_format")  # "raw": a text completion's prompt (gateway/pipeline/text_completion.py)
# Of OUTPUT_PARAMS, those whose 0 (0.0, -0.0) is no value: every tier's server reads an absent penalty as 0, and
# gateway/pipeline/tier_call.upstream_body leaves a zero one out, so a request that sends 0 is the same request
# upstream as one that leaves the field out, and is keyed as it (no KEY_VERSION bump: no other request's hash moves).
_ZERO_IS_UNSET = frozenset({"presence_penalty", "frequency_penalty"})

_WS = re.compile(r"\s+")
_LAST_USER = "<last-user>"  # in the history hash, where the last user turn's content was


def normalize_text(text: str) -> str:
    """Unicode NFKC and collapsed whitespace: for the embedding only (`embedding_text`), never for a key or a
    guard, since both erase differences that change the meaning ("2³" and "23")."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def embedding_text(last_user_text: str) -> str:
    """What the semantic layer embeds for a last user turn (as sent): NFKC with collapsed whitespace, so width,
    ligature, spacing and line-end variants of one question embed alike. The near-miss guards, not the embedding,
    tell apart what this folds together. Empty (never embedded, matched exactly only) when the turn is longer
    than the guards read: a candidate found for it could only be refused."""
    return normalize_text(last_user_text) if len(last_user_text) <= MAX_CHARS else ""


def compared_text(request: Mapping[str, Any], message: Mapping[str, Any]) -> str:
    """The text of the last user turn `message` as the semantic layer compares it (as sent): its content when
    that is a string or one text part, which every tier reads as that text. Empty, matched exactly only, for
    content of several parts (no one joined text is what every tier reads) or of no text, and for a raw
    completion's prompt (continued as sent: a line end or a trailing space the embedding and guards fold changes
    the continuation)."""
    if request.get("prompt_format") == "raw":
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], Mapping) \
            and content[0].get("type") == "text" and isinstance(content[0].get("text"), str):
        return content[0]["text"]
    return ""


# `json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)`, the same bytes, with its encoder built once:
# `json.dumps` builds a new JSONEncoder at every call that passes an option (half its ~5 us on a short chat body),
# and an exact hit hashes twice (the context hash and the exact key)
_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode


def _digest(obj: Any) -> str:
    return hashlib.sha256(_ENCODE(obj).encode()).hexdigest()


def _fields(message: Mapping[str, Any]) -> dict[str, Any]:
    """Every field of a message as sent but its content (role, name, tool calls...); a null is not set."""
    return {k: v for k, v in message.items() if k != "content" and v is not None}


def _turn(message: Mapping[str, Any]) -> list[Any]:
    """A message as the keys hash it: its fields, and its content as sent (a string, or the list of parts)."""
    return [_fields(message), message.get("content")]


def _messages(request: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(request.get("messages") or [])


def context_hash(request: Mapping[str, Any]) -> str:
    """Hash of the system prompt(s), tools and output-shaping parameters: what besides the turns shapes the answer.
    (Where each system message sits is in the exact key and the history hash, with every other message.)"""
    system = [_turn(m) for m in _messages(request) if m.get("role") in SYSTEM_ROLES]
    params = {k: v for k in OUTPUT_PARAMS
              if (v := request.get(k)) is not None and not (k in _ZERO_IS_UNSET and v == 0)}
    return _digest([KEY_VERSION, system, request.get("tools") or [], params])[:32]


def _sent(value: Any) -> str:
    """A sampling parameter as the tier gets it: 'unset' where the request leaves it out (or null: upstream_body
    drops nulls), else its number as a float, so 1 and 1.0 (one JSON number) key alike."""
    return "unset" if value is None else repr(float(value))


def sampling_class(request: Mapping[str, Any]) -> str:
    """'greedy' for temperature 0 (0, 0.0, -0.0), whatever else is sent; else the seed with the parameters a seeded
    sample depends on, as the tier is sent them (vLLM's `top_k` too: our engines honour it).

    An absent temperature or top_p is its own value, not 1.0: upstream_body sends the tier no field for it, and a
    remote tier then samples with its own default (vLLM the model's generation_config, llama.cpp's server 0.8 and
    0.95), so an answer sampled without them is no answer to a request that sends 1.0, nor the reverse. A `top_k` of
    -1 or 0 (off) is no `top_k`: upstream_body leaves it out, so the tier gets the same request as without it.

    The seeded form names its fields in full ("temperature=", not the "t=" of before) so that no class equals one
    of the old form, which read an absent temperature or top_p as 1.0: an entry an absent-temperature request
    stored under "t=1.0" is never found by a request that sends 1.0. Greedy entries keep their class (KEY_VERSION
    stays: greedy and every other hash read as before)."""
    temperature = request.get("temperature")
    if temperature is not None and float(temperature) == 0.0:
        return "greedy"
    seed = request.get("seed")
    if seed is None:
        return "sampled"
    top_k = request.get("top_k")
    if isinstance(top_k, int) and top_k <= 0:
        top_k = None
    return (f"seed:{seed}:temperature={_sent(temperature)}:top_p={_sent(request.get('top_p'))}"
            f":top_k={'unset' if top_k is None else top_k}")


@dataclass(frozen=True, slots=True)
class RequestKey:
    """The scope-independent keys of one request."""

    exact_key: str  # hash of every message as sent, in order
    history_hash: str  # hash of every message but the last user turn's compared content
    last_user_text: str  # the last user turn's text as sent (`compared_text`): read by the guards; embedded normalized

    @property
    def embedding_text(self) -> str:
        """What the semantic layer embeds for this request (`embedding_text`)."""
        return embedding_text(self.last_user_text)


def exact_key(request: Mapping[str, Any]) -> str:
    """The exact key alone (`request_key`'s first field): all an exact hit in this process's memory needs."""
    return _digest([KEY_VERSION, [_turn(m) for m in _messages(request)]])[:32]


def request_key(request: Mapping[str, Any], exact: str | None = None) -> RequestKey:
    """The exact key, the history hash and the last user turn's compared text of a chat request. `exact`: the
    request's `exact_key`, where the caller has it already."""
    messages = _messages(request)
    turns = [_turn(m) for m in messages]
    exact = _digest([KEY_VERSION, turns])[:32] if exact is None else exact
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None or not (text := compared_text(request, messages[last_user])):
        # nothing compared by meaning: the history is the whole conversation
        return RequestKey(exact, _digest([KEY_VERSION, "history", turns])[:32], "")
    # the turn's every field but its content, and its content's form (a string or one text part: either can be
    # what a tier tells apart); three items, so never the same as a message's [fields, content]
    form = "string" if isinstance(messages[last_user].get("content"), str) else "one text part"
    marked = [_fields(messages[last_user]), form, _LAST_USER]
    history = [*turns[:last_user], marked, *turns[last_user + 1:]]
    return RequestKey(exact, _digest([KEY_VERSION, "history", history])[:32], text)


@dataclass(frozen=True, slots=True)
class Cacheability:
    """Whether a request may be served from the cache (`lookup`) and whether its answer may be kept (`store`)."""

    lookup: bool
    store: bool
    reason: str  # "cacheable", or why not, e.g. "bypass: temperature>0"

    @property
    def bypass(self) -> bool:
        return not (self.lookup or self.store)


# Cache-Control: what a request may send. `no-cache` (not served from the cache; its answer may be kept), `no-store`
# (its answer not kept) and `max-age=0` (no stored answer is fresh enough: `no-cache`, as a browser's reload sends it),
# in any case, with spaces around the commas. Any other directive (`only-if-cached`, `max-age=60`, `max-stale`, a
# misspelt `no-cahce`, `no-cache="x"`) is refused by name, never dropped: a dropped `max-age=0` or `no-cahce` was
# served a stored answer the client had asked not to get. Bounded: the header is tenant input, read once, linearly.
CACHE_CONTROL_MAX_CHARS = 256
CACHE_CONTROL_MAX_ELEMENTS = 8  # list elements, empty ones (ignored, RFC 9110 section 5.6.1) included
_HONOURED = frozenset({"no-cache", "no-store"})
_ZERO_AGE = re.compile(r'0+|"0+"')
_SHOWN = 40  # of a refused directive, echoed in the message


class CacheControlRefused(ValueError):
    """A Cache-Control header with a directive the cache does not honour, or past the bounds; the message names it."""


def parse_cache_control(value: str) -> frozenset[str]:
    """The honoured directives of a Cache-Control value, lower-cased (`max-age=0` read as `no-cache`); raises
    `CacheControlRefused`, naming the directive, for anything else. Empty list elements are ignored."""
    if len(value) > CACHE_CONTROL_MAX_CHARS:
        raise CacheControlRefused(f"Cache-Control is {len(value)} characters; at most {CACHE_CONTROL_MAX_CHARS} are "
                                  "read: send no-cache, no-store or both")
    elements = value.split(",", CACHE_CONTROL_MAX_ELEMENTS)  # at most MAX + 1 parts, however many commas
    if len(elements) > CACHE_CONTROL_MAX_ELEMENTS:
        raise CacheControlRefused(f"Cache-Control has more than {CACHE_CONTROL_MAX_ELEMENTS} comma-separated "
                                  "directives: send no-cache, no-store or both")
    honoured: set[str] = set()
    for element in elements:
        if not (directive := element.strip(" \t")):
            continue
        name, eq, argument = directive.partition("=")
        name = name.lower()
        if name in _HONOURED and not eq:
            honoured.add(name)
        elif name == "max-age" and _ZERO_AGE.fullmatch(argument):
            honoured.add("no-cache")
        else:
            shown = directive if len(directive) <= _SHOWN else directive[:_SHOWN] + "..."
            why = (" (an answer's age is not checked: send no-cache not to be served a stored answer)"
                   if name == "max-age" else "")
            raise CacheControlRefused(f"Cache-Control directive '{shown}' is not honoured{why}; the gateway honours "
                                      "no-cache, no-store and max-age=0 (as no-cache)")
    return frozenset(honoured)


class ReadHeaders(dict[str, str]):
    """A request's headers by lower-case name, with its Cache-Control already read: `cache_control` holds what
    `parse_cache_control` made of it, and `cache_control()` hands that on rather than parsing the value again.
    The gateway builds one per model request (gateway/request_headers.py, where a directive the cache does not
    honour is refused) and hands it through the pipeline to the cache's lookup and store."""

    def __init__(self, headers: Mapping[str, str], cache_control: frozenset[str]) -> None:
        super().__init__(headers)
        self.cache_control = cache_control  # the honoured directives of headers["cache-control"]; empty without one


def cache_control(headers: Mapping[str, str] | None) -> frozenset[str]:
    """The request's honoured Cache-Control directives (header names are matched case-insensitively; `ReadHeaders`
    carry theirs, read once); raises `CacheControlRefused` for one it does not honour. The gateway refuses such a
    request before any work (gateway/request_headers.py); a caller of the cache's own API passes only headers this
    accepts."""
    if isinstance(headers, ReadHeaders):
        return headers.cache_control
    if not headers:
        return frozenset()
    value = next((v for k, v in headers.items() if k.lower() == "cache-control"), "")
    return parse_cache_control(value) if value else frozenset()


def decide(request: Mapping[str, Any], headers: Mapping[str, str] | None = None, *,
           pure_tools: Collection[str] = ()) -> Cacheability:
    """Apply the cacheability rules: deterministic sampling, no side-effecting tools, Cache-Control.

    `pure_tools` names the tools the tenant declared free of side effects; a request offering any other
    tool is never cached, because answering it from the cache would skip an action the client expects.
    """
    if sampling_class(request) == "sampled":
        return Cacheability(False, False, "bypass: temperature>0 without seed")
    if int(request.get("n") or 1) > 1:
        return Cacheability(False, False, "bypass: n>1")
    if request.get("logprobs"):  # a stored answer keeps its text, not its log-probabilities
        return Cacheability(False, False, "bypass: logprobs")
    tools = request.get("tools") or []
    impure = sorted({str((t.get("function") or {}).get("name", t.get("type"))) for t in tools} - set(pure_tools))
    if impure and request.get("tool_choice") != "none":
        return Cacheability(False, False, f"bypass: tools with side effects ({', '.join(impure)})")
    if not any(m.get("role") == "user" for m in _messages(request)):
        return Cacheability(False, False, "bypass: no user turn")
    directives = cache_control(headers)
    lookup, store = "no-cache" not in directives, "no-store" not in directives
    if not (lookup or store):
        return Cacheability(False, False, "bypass: cache-control no-cache, no-store")
    if not lookup:
        return Cacheability(False, True, "bypass lookup: cache-control no-cache")
    if not store:
        return Cacheability(True, False, "no store: cache-control no-store")
    return Cacheability(True, True, "cacheable")


_LARGE = 1 << 20  # what a message with content parts or tool calls counts as


def conversation_chars(request: Mapping[str, Any]) -> int:
    """About how many characters the request's keys hash (its messages' string contents), without walking
    content parts or tool calls (each counts as large): how much work computing the keys is."""
    total = 0
    for message in request.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if isinstance(content, str) and not message.get("tool_calls"):
            total += len(content)
        elif content is not None or message.get("tool_calls"):
            total += _LARGE
    return total
