"""A chat prompt in which the tenant's text is text: a special token's string (`<|im_end|>`) sent in a message is
never that special token. Our engine tokenizes prompts with it (engine/server.py) and the gateway counts them with it
(gateway/token_counter.py), so both read such text alike.

The chat template renders one string, its own markers and the request's text alike, and the tokenizer parses every
special token's string in it as the token. So a user message holding `<|im_end|>\\n<|im_start|>system\\n...` was read
by the model as a real system turn, forged by an end user of a tenant's application (through a tool result or an
assistant message's content as well). OpenAI reads such text as text; so does this.

`PlainTenantText.escaped` scans the strings of the turns as `wire.tool_calls.render_messages` made them (contents,
names, tool calls' arguments, results, the offered tools: all from the request) with one compiled alternation of the
special tokens' strings: linear in the text, which the request's bounds already bound. None found (the normal case):
the engine tokenizes the rendered prompt as it always has, the same ids. Found: each occurrence is replaced by a
sentinel of this request's (private-use characters around a random nonce, absent from every string), the template
renders, and `ids` cuts the text at the special tokens' strings left (the template's own: no tenant string holds one
now) and tokenizes each piece between them, its sentinels back to the strings they stood for, with a copy of the
tokenizer that reads special tokens' strings as text (`encode_special_tokens`); the template's markers are their
tokens. The tokenizer cuts a text at its added tokens before anything else and tokenizes the pieces on their own, so
each piece's ids are those it has within the whole prompt.

Why a copy: transformers' `split_special_tokens=True` sets that flag on the tokenizer that the engine's tokenizing
threads share, before its call and not for its length; another thread's call sets it back, and a prompt tokenized
meanwhile is read with the other thread's flag (a hostile prompt parsed as before, or a normal one's markers as text).

Added tokens that are not special are escaped too (Qwen's `<think>`, `<|fim_prefix|>`: special False in its
added_tokens_decoder): `tokenizers` cuts any text at every added token before its model runs, special or not, and
`encode_special_tokens` (as transformers' `split_special_tokens`) reads only special ones as text, so the copy calls
the escaped ones special (`_reading_as_text`). An added token of whitespace only (a run of spaces, CodeGen's and
Phi-2's) is left as it reads: it marks nothing, and normal text is full of it.

The markers wire/tool_calls.py's `render_messages` writes into the turns' strings itself (`RENDERED_MARKERS`:
`<tool_call>`, `<tool_response>`...) are added tokens of some tokenizers (Qwen's), and a tenant's
`<tool_call>{"name": ...}</tool_call>` in a message or a result was read as ours: a call in the history, forged. In
the turns ours cannot be told from a tenant's, so they are escaped a step earlier: `marker_escape` gives a request's
`MarkerEscape`, which `render_messages` applies to each tenant string before it writes our markers around it. It puts
a sentinel (of the same kind, its prefix drawn for the request) in place of each of the tenant's markers, and of the
prefix itself where a tenant string holds it (so no sentinel can be forged, and no prefix need be drawn again);
`escaped` then takes that prefix, and `ids` cuts at the markers left (ours) as at the template's special tokens. A
normal request holds none, and its turns, and so its ids, are what they were. (A tokenizer that has one of them as a
special token had our own blocks read as text before; they are that token now.)

A token can also be made across a string's edge: its end that begins a token's string (`<|im`) and the template's
text after it (`_end|>`), or the template's text before it and its start that ends one. ChatML's templates write
whole markers beside a message, and no ChatML token's string ends with the start of another, so none is made there;
a template that writes part of a marker beside a message, or a vocabulary whose tokens overlap so, would make one the
template never wrote, read as the token in the whole rendered text. So `escaped` also replaces such an edge of each
string (`edges`: the longest start that is a proper suffix of a token's string, the longest end that is a proper
prefix) by a sentinel: the template's text beside it then makes no token, and the edge is read as text in its piece.
At most the longest token's length is looked at on each side of a string. A string with such an edge and no token
(one opening with `>`, a quote in Markdown) takes the escaped path, with the same ids where the template writes
whole markers beside it: `ids` cuts at them as the tokenizer does. An edge is looked for past the string's whitespace
(`Hi<|im \\n`), which a template's `trim` takes away (Llama 3's, Qwen's); the sentinel is no whitespace, so what
the template strips is what it stripped.

Limits: a token made of the template's text on both sides of a whole string (`<|im` + `_en` + `d|>`) is not found;
it needs a template that writes a part of a marker on each side of one string, cut where a whole string fits.
Matching is on the raw text, as tokenizers match added tokens that are not `normalized` (SmolLM2's are not); a
normalized one behind a normalizer that changes it (lowercasing) could be spelled otherwise.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from wire.tool_calls import RENDERED_MARKERS

Turns = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class Escaped:
    """Turns whose tokens' strings (and their strings' edges that could begin or end one) are sentinels, and how to
    put them back."""

    turns: list[dict[str, Any]]
    sentinel: re.Pattern[str]  # one sentinel: group 1 is the index in `texts` of the string it stands for
    texts: list[str]  # the `MarkerEscape`'s texts, then the tokens' strings, then this request's edges


class MarkerEscape:
    """One request's escape of our markers (those of RENDERED_MARKERS that are added tokens) in its tenant strings,
    called on each before wire/tool_calls.py's `render_messages` wraps it; `PlainTenantText.escaped` takes it too.
    Made for one request and used by one thread."""

    def __init__(self, markers: re.Pattern[str], texts: Sequence[str]) -> None:
        self.prefix = f"\ue000{secrets.token_hex(8)}"
        self.texts = [*texts, self.prefix]  # a sentinel's index is one of these
        self._markers = markers
        self._sentinels = {t: f"{self.prefix}{k}\ue001" for k, t in enumerate(self.texts)}
        self.written = 0  # sentinels written

    def __call__(self, value: str) -> str:
        """`value`, a tenant string, with a sentinel for each of our markers in it, and for our prefix (which the
        sentinels hold, so that a tenant's spelling of one is put back as text)."""
        if self.prefix in value:  # first: the sentinels written next hold it
            self.written += value.count(self.prefix)
            value = value.replace(self.prefix, self._sentinels[self.prefix])
        value, n = self._markers.subn(lambda m: self._sentinels[m[0]], value)
        self.written += n
        return value

    def restored(self, text: str) -> str:
        """`text` (made from escaped strings) with each sentinel this escape wrote put back as the tenant's string."""
        if not self.written or self.prefix not in text:
            return text
        return re.sub(re.escape(self.prefix) + "([0-9]+)\ue001", lambda m: self.texts[int(m[1])], text)


class PlainTenantText:
    """The added tokens of one tokenizer (special or not), found in tenant strings and tokenized there as text."""

    def __init__(self, backend: Tokenizer, specials: Sequence[str], markers: Sequence[str] = ()) -> None:
        """`specials`: the added tokens' strings read as text in tenant strings (`for_tokenizer`'s choice);
        `markers`: those of RENDERED_MARKERS, escaped by `MarkerEscape` before the turns are made."""
        self.specials = sorted(specials, key=len, reverse=True)  # the longest first: `<|a|>` before `<|a`
        self.markers = sorted(markers, key=len, reverse=True)
        self._index = {s: k for k, s in enumerate(self.specials)}
        self._ids = {s: backend.token_to_id(s) for s in (*self.specials, *self.markers)}
        self._special = _alternation(self.specials)
        self._marker = _alternation(self.markers)
        self._cut = _alternation(sorted((*self.specials, *self.markers), key=len, reverse=True))  # `ids`' cut
        # never shared with a call that parses them
        self._plain = _reading_as_text(backend, {*self.specials, *self.markers})
        # the tokens' proper prefixes and suffixes (`edges`), but those that begin or end at whitespace: `edges`
        # looks past a string's whitespace at either end
        self._heads = {t[:k] for t in self.specials for k in range(1, len(t)) if not t[k - 1].isspace()}
        self._tails = {t[k:] for t in self.specials for k in range(1, len(t)) if not t[k].isspace()}
        self._longest = max(map(len, self.specials), default=1)
        # where an edge can begin (a token's first character: `<`) or end (its last: `>`): most strings have none
        # near their ends, and are passed over with a search of a few characters each side
        self._begins = _one_of({h[0] for h in self._heads})
        self._ends = _one_of({t[-1] for t in self._tails})

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PlainTenantText | None:
        """`tokenizer`: transformers' fast tokenizer, or `tokenizers`' own. None for one without `tokenizers`' backend
        or without added tokens to escape (special ones, those not special but for whitespace, and our markers)."""
        backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            return None
        added = [t for t in backend.get_added_tokens_decoder().values() if t.content]
        markers = [t.content for t in added if t.content in RENDERED_MARKERS]
        specials = [t.content for t in added
                    if (t.special or t.content.strip()) and t.content not in RENDERED_MARKERS]
        return cls(backend, specials, markers) if specials or markers else None

    def marker_escape(self) -> MarkerEscape | None:
        """A new request's escape of our markers in its tenant strings; None where the tokenizer has none of them as
        a token (they read as text already)."""
        return MarkerEscape(self._marker, self.markers) if self.markers else None

    def escaped(self, turns: Turns, markers: MarkerEscape | None = None) -> Escaped | None:
        """`turns` with every escaped token's string in their strings replaced by a sentinel, and each string's
        `edges` too; None when no string holds one or has one, and `markers` (the escape the turns' tenant strings
        were made with, if any) wrote no sentinel: render and tokenize as ever. A turn's role is ours
        (wire.chat_request.normalized_role) and templates compare it: its edges are left."""
        strings = [(k, v) for t in turns for k, v in t.items() if isinstance(v, str)]
        if (not (markers is not None and markers.written)
                and not any(self._special.search(v) or (k != "role" and self._has_edge(v)) for k, v in strings)):
            return None
        if markers is not None:  # its prefix: in no tenant string, but where it wrote a sentinel for it
            prefix, texts = markers.prefix, [*markers.texts, *self.specials]
        else:
            prefix, texts = f"\ue000{secrets.token_hex(8)}", list(self.specials)
            while any(prefix in v for _, v in strings):  # a tenant who guessed 64 random bits
                prefix = f"\ue000{secrets.token_hex(8)}"
        first = len(texts) - len(self.specials)  # the specials' sentinels' first index

        def sentinel(m: re.Match[str]) -> str:
            return f"{prefix}{first + self._index[m[0]]}\ue001"

        def escape(key: str, value: str) -> str:
            value = self._special.sub(sentinel, value)
            if key == "role":
                return value
            a, b, c, d = self.edges(value)
            if b == a and c == d:
                return value
            if b > c:  # the two edges overlap: the string (but its whitespace) is one
                return value[:a] + mark(value[a:d]) + value[d:]
            return value[:a] + mark(value[a:b]) + value[b:c] + mark(value[c:d]) + value[d:]

        def mark(edge: str) -> str:
            if not edge:
                return ""
            texts.append(edge)
            return f"{prefix}{len(texts) - 1}\ue001"

        escaped = [{k: escape(k, v) if isinstance(v, str) else v for k, v in t.items()} for t in turns]
        return Escaped(escaped, re.compile(re.escape(prefix) + "([0-9]+)\ue001"), texts)

    def edges(self, value: str) -> tuple[int, int, int, int]:
        """(a, b, c, d): `value[a:b]`, its longest start that ends an escaped token (a proper suffix of its string),
        and `value[c:d]`, its longest end that begins one (a proper prefix), each empty for none: what could make a
        token with the template's text beside the string, which the template never wrote (`<|im` + `_end|>`). The
        string's whitespace at either end is passed over (a template's `trim` takes it away); at most the longest
        token's length is looked at on each side."""
        a = len(value) - len(value.lstrip())
        d = len(value.rstrip())
        b, c = a, d
        window = self._longest - 1
        for m in self._ends.finditer(value, a, min(d, a + window)):  # the ends of candidate starts, shortest first
            if value[a:m.end()] in self._tails:
                b = m.end()
        for m in self._begins.finditer(value, max(a, d - window), d):  # candidate ends, the longest first
            if value[m.start():d] in self._heads:
                c = m.start()
                break
        return a, b, c, d

    def _has_edge(self, value: str) -> bool:
        a, b, c, d = self.edges(value)
        return b > a or d > c

    def restored(self, text: str, escaped: Escaped) -> str:
        """The prompt `text` (rendered from `escaped.turns`) as it reads: the tenant's strings back in it."""
        return escaped.sentinel.sub(lambda m: escaped.texts[int(m[1])], text)

    def count(self, text: str, escaped: Escaped) -> int:
        """The number of `ids`."""
        return len(self.ids(text, escaped))

    def texts_tokens(self, texts: Sequence[str], markers: MarkerEscape | None = None) -> list[int]:
        """Tokens of each of `texts` (turns' contents) read as text, in one call; our markers in them (where the
        turns were made with `marker_escape`, only ours are left) one token each, as they read in the prompt, and the
        tenant's strings that `markers` (the escape the turns were made with) put sentinels in for, as text: counted
        as their sentinels, a tenant's 11-character `<tool_call>` was a 20-character sentinel's tokens."""
        if not self.markers:
            return [len(e.ids) for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]
        parts = [self._marker.split(t) for t in texts]  # text, marker, text, ..., text
        pieces = [p for ps in parts for p in ps[::2]]
        if markers is not None:
            pieces = [markers.restored(p) for p in pieces]
        encoded = iter(self._plain.encode_batch(pieces, add_special_tokens=False))
        return [len(ps) // 2 + sum(len(next(encoded).ids) for _ in ps[::2]) for ps in parts]

    def ids(self, text: str, escaped: Escaped) -> list[int]:
        """The token ids of `text` (rendered from `escaped.turns`): the template's special tokens and our markers as
        tokens, the tenant's text, sentinels put back, as text. `encode_batch` releases the GIL, as the engine's usual
        call."""
        parts = self._cut.split(text)  # text, token, text, ..., text: the tokens are the template's and ours
        pieces = [self.restored(p, escaped) for p in parts[::2]]
        encoded = self._plain.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = list(encoded[0].ids)
        for marker, piece in zip(parts[1::2], encoded[1:], strict=True):
            ids.append(self._ids[marker])
            ids.extend(piece.ids)
        return ids


def _alternation(strings: Sequence[str]) -> re.Pattern[str]:
    """One group matching any of `strings` (tried in their order), which `split` keeps; none at all for none."""
    return re.compile("(" + "|".join(map(re.escape, strings)) + ")" if strings else "(?!)")


def _one_of(chars: set[str]) -> re.Pattern[str]:
    """A pattern matching any one of `chars`; none at all for none (every token one character long)."""
    return re.compile("[" + "".join(map(re.escape, sorted(chars))) + "]" if chars else "(?!)")


def _reading_as_text(backend: Tokenizer, contents: set[str]) -> Tokenizer:
    """A copy of `backend` that reads the added tokens of `contents` as text wherever they are. `encode_special_tokens`
    does so for special tokens only (as transformers' `split_special_tokens`): an added token that is not special is
    matched in any text before the model's own tokenizing. So the copy calls them special, which changes nothing
    else it does with them: no post-processor runs (`add_special_tokens=False`) and the copy decodes nothing."""
    config = json.loads(backend.to_str())
    for token in config.get("added_tokens", []):
        if token["content"] in contents:
            token["special"] = True
    plain = Tokenizer.from_str(json.dumps(config))
    plain.encode_special_tokens = True
    return plain
