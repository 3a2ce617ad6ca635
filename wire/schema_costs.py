"""What a JSON Schema's patterns and references would cost a grammar compiler, refused before it compiles.

A schema passes our size, depth and intersection bounds (wire/response_format.py, wire/schema_alternatives.py) and
can still fail only once an engine decodes with it: llguidance (engine/grammar.py) compiles lazily, in about a
millisecond whatever the schema, and pays for a pattern's counted repetitions when a sequence first reaches it, on
the engine's step loop, for every sequence of the batch. Measured on SmolLM2's vocabulary (one core, 2026-12-06):
`^(a{1000}){1000}$` held the step loop 0.75 s and 185 MiB, `^a{1000000}$` 0.26 s and 58 MiB, then each failed
("too many expressions constructed"); `^a{100000}$` passed but took 0.22 s a token; `^(a+){1000}$` failed at once.
And a schema that refers to itself without going into a property or an item (`{"allOf": [{"$ref": "#"}]}`,
`{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`) compiled and failed at the first token. Each was a
400 `response_format_failed` only after the request had been admitted: quota reserved, a queue place, a batch slot.

Three checks, one pass each, linear in the schema's size:
- `check_patterns`: every `pattern` (and `patternProperties` name) weighs its atoms, each times the counts of the
  repetitions around it (`{m,n}` counts max(m, n); `*`, `+` and `?` once, but a counted repetition of a group that
  itself repeats without bound counts its count squared: `(a+){1000}`). A pattern may weigh at most
  MAX_PATTERN_WEIGHT (10,000: `^a{10000}$` and `^(a{100}){100}$` masked in under 40 ms a token), or its own length
  where that is more (a long pattern that repeats nothing weighs what a `const` that long does). The scan reads
  ECMA-262 regexes as llguidance does closely enough to weigh them; it never decides whether one is valid (the
  compiler says so, as before). A `minLength` beside a pattern (or joined to one by `allOf` or `$ref`,
  which llguidance merges) may be at most MAX_MIN_LENGTH_BESIDE_PATTERN (2,000):
  llguidance meets the two character by character (`^a*$` with minLength 3,000: 48 ms a token; 5,000: "too many
  expressions constructed" at the first token).
- `check_self_references`: no `$ref` may lead back to a subschema that reached it through in-place keywords only
  (`allOf`, `anyOf`, `oneOf`, `not`, `if`/`then`/`else`, `dependentSchemas`, `$ref`): such recursion never nests
  into the value: a validator following it never ends, and llguidance failed on the first token (or at compile
  time, "circular references with sibling keys"). Recursion through `properties`, `items` and the like (a tree)
  passes. A cycle with a way out (`{"anyOf": [{"type": "string"}, {"$ref": "#"}]}`, which llguidance takes) is
  refused too: it says no more than its way out does.
- `check_answer_length`: the fewest characters any answer valid against the schema holds (a lower bound: minItems
  times its items', minLength, a pattern's fewest characters, required properties, consts, what a `$ref` points
  to; the fewest of an anyOf's branches) may be at most MAX_ANSWER_CHARS (100,000). llguidance computes what a
  schema forces ahead, on the step loop: 1,000 required strings of `^a{5000}$` cost 2.3 s and 289 MiB a token,
  100,000 of them 29.5 s and 2 GiB and then a failure, a million required `"x"` failed at the first token; and no
  model writes an answer that long.

A refusal is a pydantic ValidationError whose location goes on from the schema's (`...schema.properties.a.pattern`),
so the 400 names the keyword itself (wire/validation.py `describe`).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from wire.regex_costs import MAX_PATTERN_WEIGHT, pattern_limit, pattern_min_chars, pattern_weight
from wire.schema_alternatives import MAX_PATH_LENGTH, MAX_REFERENCE_HOPS, resolve_ref

MAX_ANSWER_CHARS = 100_000  # the fewest characters an answer valid against the schema may hold
MAX_MIN_LENGTH_BESIDE_PATTERN = 2_000  # a string's minLength where it has a pattern too
VALUES = frozenset({"enum", "const", "default", "examples"})  # instances, not subschemas: never read as schemas
# names to subschemas: a name is never read as a keyword (a property named `enum` or `pattern` is a subschema)
NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_ONE = ("not", "if", "then", "else")

Path = tuple[str | int, ...]


def refuse(path: Path, message: str) -> ValidationError:
    """A refusal located at `path` inside the schema, with `message` as its text (code `value_error`, as the other
    schema bounds)."""
    error = PydanticCustomError("value_error", "{reason}", {"reason": message})
    return ValidationError.from_exception_data("schema", [InitErrorDetails(type=error, loc=path, input=None)])


def check_patterns(schema: dict[str, Any]) -> None:
    """Raise a ValidationError located at the first `pattern` (or `patternProperties` name) that weighs more than
    MAX_PATTERN_WEIGHT, or at a minLength past MAX_MIN_LENGTH_BESIDE_PATTERN that one string must meet with a
    pattern (beside it, or joined to it by `allOf` or `$ref`). Iterative; each node visited once."""
    stack: list[tuple[Any, Path]] = [(schema, ())]
    long_min: list[tuple[dict[str, Any], Path]] = []  # schemas with a minLength past the bound, and no pattern
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, (*path, j)) for j, v in enumerate(node) if isinstance(v, dict | list))
            continue
        stack += subschemas(node, path)
        if isinstance(pattern := node.get("pattern"), str):
            _check_pattern(pattern, (*path, "pattern"))
        if _int(node.get("minLength")) > MAX_MIN_LENGTH_BESIDE_PATTERN:
            long_min.append((node, path))
        if isinstance(named := node.get("patternProperties"), dict):
            for name in named:
                _check_pattern(name, (*path, "patternProperties", name))
    _check_min_length_beside_pattern(schema, long_min)


def _check_min_length_beside_pattern(root: dict[str, Any], long_min: list[tuple[dict[str, Any], Path]]) -> None:
    """Refuse the first of `long_min` that one string must meet with a pattern: its own, or one joined to it by
    `allOf` or `$ref`, which llguidance merges into the string's (`{"allOf": [{"pattern": "^a*$"}, {"minLength":
    5000}]}`, or a `$ref` to a patterned string beside the minLength: "too many expressions constructed" at the first
    token, as beside it). A schema is joined to what it reaches that way and to what reaches it (one member of an
    allOf meets its siblings)."""
    if not long_min:
        return
    # the schemas joined by allOf and $ref, each group one string: a union-find over them, by identity
    parent: dict[int, int] = {}

    def find(key: int) -> int:
        while (up := parent.get(key, key)) != key:
            parent[key] = parent.get(up, up)  # halving the path: many schemas joined to one stay cheap to find
            key = up
        return key

    def join(a: dict[str, Any], b: dict[str, Any]) -> None:
        parent[find(id(a))] = find(id(b))

    patterned: list[int] = []
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack += [v for v, _ in subschemas(node, ())]
        if isinstance(node.get("pattern"), str):
            patterned.append(id(node))
        for branch in node.get("allOf") if isinstance(node.get("allOf"), list) else ():
            if isinstance(branch, dict):
                join(branch, node)
        if isinstance(ref := node.get("$ref"), str):
            try:
                target = resolve_ref(root, ref)
            except ValueError:  # refused by check_self_references
                continue
            if isinstance(target, dict):
                join(target, node)
    with_pattern = {find(key) for key in patterned}
    for node, path in long_min:
        if find(id(node)) in with_pattern:
            raise refuse((*path, "minLength"), f"a minLength beside a pattern may be at most "
                                               f"{MAX_MIN_LENGTH_BESIDE_PATTERN:,}: a grammar meets the two "
                                               f"character by character")


def subschemas(node: dict[str, Any], path: Path) -> list[tuple[Any, Path]]:
    """What a schema object holds that may be, or hold, subschemas, with their paths: every value but an instance's
    (`enum`, `const`...), and each named subschema of a map of names (`properties`...), whatever its name."""
    found: list[tuple[Any, Path]] = []
    for key, value in node.items():
        if key in NAMED and isinstance(value, dict):
            found += [(v, (*path, key, name)) for name, v in value.items() if isinstance(v, dict | list)]
        elif key not in VALUES and isinstance(value, dict | list):
            found.append((value, (*path, key)))
    return found


def _check_pattern(pattern: str, path: Path) -> None:
    if "{" not in pattern:  # no counted repetition: every factor is 1, so it weighs at most its length
        return
    if pattern_weight(pattern) > (limit := pattern_limit(pattern)):
        raise refuse(path, f"the pattern repeats too much for a grammar: its characters, each times the repetition "
                           f"counts around it, weigh more than {limit:,} (at most {MAX_PATTERN_WEIGHT:,}, or the "
                           f"pattern's length); use smaller counts, or `maxLength` for a string's length")


def check_self_references(schema: dict[str, Any]) -> None:
    """Raise a ValidationError located at the first `$ref` (or in-place keyword) that leads back, through in-place
    keywords only, to a subschema on its own path. Every subschema starts a depth-first walk of the in-place
    keywords unless an earlier walk entered it; iterative, each subschema entered once (by identity)."""
    done: set[int] = set()
    pending: list[tuple[Any, Path]] = [(schema, ())]
    while pending:
        node, path = pending.pop()
        if isinstance(node, list):
            pending.extend((v, (*path, j)) for j, v in enumerate(node) if isinstance(v, dict | list))
            continue
        if id(node) not in done:
            _walk_in_place(schema, node, path, done)
        pending += subschemas(node, path)


def _in_place(root: dict[str, Any], node: dict[str, Any], path: Path) -> list[tuple[Any, Path, Path]]:
    """The subschemas `node` applies to its own value: each with its own path, and the path of the keyword that
    leads to it (for a `$ref`, the `$ref` itself; its target's path is where the pointer points)."""
    children: list[tuple[Any, Path, Path]] = []
    for key in _IN_PLACE_LISTS:
        if isinstance(branches := node.get(key), list):
            children += [(b, (*path, key, j), (*path, key, j)) for j, b in enumerate(branches) if isinstance(b, dict)]
    for key in _IN_PLACE_ONE:
        if isinstance(sub := node.get(key), dict):
            children.append((sub, (*path, key), (*path, key)))
    if isinstance(named := node.get("dependentSchemas"), dict):
        children += [(s, (*path, "dependentSchemas", k), (*path, "dependentSchemas", k))
                     for k, s in named.items() if isinstance(s, dict)]
    if isinstance(ref := node.get("$ref"), str):
        try:
            target = resolve_ref(root, ref)
        except ValueError as exc:
            raise refuse((*path, "$ref"), str(exc)) from None
        if isinstance(target, dict):
            where = tuple(unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")) \
                if ref != "#" else ()
            children.append((target, where, (*path, "$ref")))
    return children


def _walk_in_place(root: dict[str, Any], start: dict[str, Any], path: Path, done: set[int]) -> None:
    """The depth-first walk of `check_self_references` from `start`, marking what it enters `done`."""
    on_path: set[int] = {id(start)}
    stack: list[tuple[Any, list[tuple[Any, Path, Path]]]] = [(start, _in_place(root, start, path))]
    while stack:
        node, children = stack[-1]
        if not children:
            stack.pop()
            on_path.discard(id(node))
            done.add(id(node))
            continue
        child, child_path, via = children.pop()
        if id(child) in on_path:
            raise refuse(via, "the schema refers to itself without going into a property or an item (through allOf, "
                              "anyOf, oneOf, not, if/then/else or $ref only): no value can satisfy it, and a grammar "
                              "cannot be built for it")
        if id(child) not in done:
            on_path.add(id(child))
            stack.append((child, _in_place(root, child, child_path)))


def answer_min_chars(schema: Any, root: Any = None, _refs: dict[int, int] | None = None, _hops: int = 0,
                     _length: int = 0) -> int:
    """A lower bound of the characters of any JSON value valid against `schema`, as our grammars write JSON (", "
    and ": "), capped past MAX_ANSWER_CHARS: the longest of what its own keywords, its `allOf` and its local `$ref`
    force, the fewest of its `anyOf`'s or `oneOf`'s. A `$ref` is read against `root` (`schema` itself by default),
    each target counted once (`_refs`), and one reached again while it is being counted counts 0: a lower bound
    still (a `$ref` that counted 0 let `{"items": {"$ref": "#/$defs/s"}, "minItems": 1000}` of `^a{5000}$` strings
    through, which forces what the same items written in place do).

    Recursive: a ValidationError (at the schema) past MAX_REFERENCE_HOPS references (`_hops`) or MAX_PATH_LENGTH
    subschemas and references (`_length`) on one path, the bounds of `check_alternatives`. That count remembers each
    node it counted, so it let a chain of 1,150 references, each to the one defined before it (28.9 KB), through to
    here, where it ran past Python's stack: a 500 for every request that sent it."""
    if not isinstance(schema, dict):
        return 0
    if _length > MAX_PATH_LENGTH:
        raise refuse((), f"the schema nests more than {MAX_PATH_LENGTH} subschemas and references deep")
    root = schema if root is None else root
    refs: dict[int, int] = {} if _refs is None else _refs

    def fewest(sub: Any, hops: int = _hops) -> int:
        return answer_min_chars(sub, root, refs, hops, _length + 1)

    cap = MAX_ANSWER_CHARS + 1
    bounds = [0]
    if isinstance(ref := schema.get("$ref"), str):
        try:
            target = resolve_ref(root, ref)
        except ValueError:  # refused by check_self_references where it runs; a lower bound here
            target = None
        if isinstance(target, dict):
            if id(target) not in refs:
                if _hops >= MAX_REFERENCE_HOPS:
                    raise refuse((), f"the schema follows more than {MAX_REFERENCE_HOPS} references on one path")
                refs[id(target)] = 0  # reached again while being counted: 0
                refs[id(target)] = fewest(target, _hops + 1)
            bounds.append(refs[id(target)])
    if "const" in schema:
        bounds.append(len(json.dumps(schema["const"], ensure_ascii=False)))
    if isinstance(values := schema.get("enum"), list) and values:
        bounds.append(min(len(json.dumps(v, ensure_ascii=False)) for v in values))
    for key in ("anyOf", "oneOf"):
        if isinstance(branches := schema.get(key), list) and branches:
            bounds.append(min(fewest(b) for b in branches))
    if isinstance(branches := schema.get("allOf"), list):
        bounds += [fewest(b) for b in branches]
    kind = schema.get("type")
    if kind == "string":
        pattern = schema.get("pattern")
        bounds.append(2 + max(_int(schema.get("minLength")),
                              pattern_min_chars(pattern, MAX_ANSWER_CHARS) if isinstance(pattern, str) else 0))
    elif kind == "array":
        items = min(_int(schema.get("minItems")), cap)
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        each = [fewest(p) + 2 for p in prefix[:items]]
        rest = (items - len(each)) * (fewest(schema.get("items")) + 2) if items > len(each) else 0
        bounds.append(2 + sum(each) + rest)
    elif kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        bounds.append(2 + sum(len(name) + 6 + fewest(props.get(name))
                              for name in dict.fromkeys(required) if isinstance(name, str)))
    return min(max(bounds), cap)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def check_answer_length(schema: dict[str, Any]) -> None:
    """Raise a ValidationError (at the schema) when every answer valid against it holds more than MAX_ANSWER_CHARS:
    llguidance computes the characters such a schema forces ahead, on the engine's step loop (an array of at least
    1,000 strings of `^a{5000}$`: 2.3 s and 289 MiB a token, for the whole batch; 100,000 of them: 29.5 s and 2 GiB,
    then a failure), and no answer that long fits any model's output."""
    if answer_min_chars(schema) > MAX_ANSWER_CHARS:
        raise refuse((), f"every answer this schema allows holds more than {MAX_ANSWER_CHARS:,} characters (its "
                         f"minItems, minLength, patterns and required properties together); no model writes an "
                         f"answer that long, and a grammar would force it ahead")
