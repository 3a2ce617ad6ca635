"""How many alternatives a JSON Schema makes a grammar compiler intersect, bounded before it compiles.

A grammar compiler reads the constraints that one node puts together as an intersection: the branches of an
`allOf`, an `anyOf` beside a `oneOf`, a `$ref` beside its siblings. Each side's alternatives meet every other
side's, so the work multiplies. Measured with llguidance (our engines' compiler, engine/grammar.py) on one core,
`allOf` of k branches each `anyOf` 5 string patterns: k = 2 1.7 ms, 3 9.6 ms, 4 62 ms, 5 0.42 s, 6 2.6 s, and the
last fails at the end ("grammar too big") after its parser limits let it run. A 1.4 KB schema could take 2.6 s of an
engine's CPU for every request that sent it, and a new letter in a pattern made each one new. A review found the
same product through `$ref` chains with a sibling `anyOf`, an `anyOf` beside a nested `oneOf`, and references
written so that a reader that knows only `#/$defs/x` cannot follow them (1.6-1.7 s each), and the sum of such
costs over a request's tools (3.9 s for 12).

`check_alternatives` counts, at every node, the product of what it intersects: the sum over its `anyOf`, times the
sum over its `oneOf`, times the product over its `allOf` branches, times what its `$ref` points to. Where two or
more of those meet (an intersection), the product may be at most MAX_INTERSECTED_ALTERNATIVES (256: about 25 ms
of compiling at worst by the figures above), and the products of every intersection in the schema may add up to
at most MAX_INTERSECTION_WEIGHT (what `check_alternatives` returns; summed over a request's tools too,
wire/tools.py). A
node's alternatives carry upward times the most that any of its other subschemas (properties, items...) holds,
since two branches' objects meet property by property; the count errs high (two branches' different properties
never meet), which refuses some schemas a compiler would take quickly: a schema that needs more says so plainly.
A `$ref` must be a JSON pointer into the schema itself (`#`, `#/$defs/x`, escapes and percent-encoding read as the
standard says); any other is refused, as a reference the count cannot follow. One pass, each node counted once
(remembered by identity); a reference back to a node being counted adds nothing (compilers do not expand
recursion); at most MAX_REFERENCE_HOPS references and MAX_PATH_LENGTH nested subschemas on one path.

`may_intersect` reads the schema's compact JSON first: a schema that names no `allOf`, `oneOf` or `$ref` cannot
intersect (an `anyOf` alone is one factor) nor point anywhere, so the count would find nothing to refuse and a
weight of 0; it is not walked (a 28 KB response_format parsed on the gateway's event loop in 2.3x less time:
`python -m bench.hot_path_micro`).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import unquote

MAX_INTERSECTED_ALTERNATIVES = 256  # at one node
MAX_INTERSECTION_WEIGHT = 1024  # every intersection of a schema (or of a request's tools) together
MAX_REFERENCE_HOPS = 64  # `$ref`s followed on one path from the root
MAX_PATH_LENGTH = 200  # subschemas and references on one path (the count recurses: Python's stack is ~1,000 deep)
_ALTERNATIVES = ("anyOf", "oneOf")
_SKIPPED = frozenset({"allOf", "$ref", "anyOf", "oneOf", "$defs", "definitions", "enum", "const", "examples",
                      "default", "required"})  # counted apart, or values that are not subschemas
_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas"})  # names to subschemas
# The keys an intersection or a reference needs, as compact JSON writes them (a string's own quotes are escaped
# inside it, so these occur only as a key, or as a string value that is exactly the word: then the count runs)
_INTERSECTING = tuple(f'"{key}"' for key in ("allOf", "oneOf", "$ref"))
_INTERSECTING_BYTES = tuple(key.encode() for key in _INTERSECTING)


def may_intersect(compact_json: str | bytes) -> bool:
    """False when the schema, as JSON, names no `allOf`, `oneOf` or `$ref`: `check_alternatives` would then return 0
    and refuse nothing (its nesting is bounded by `check_schema_bounds`' depth, far below MAX_PATH_LENGTH)."""
    keys = _INTERSECTING_BYTES if isinstance(compact_json, bytes) else _INTERSECTING
    return any(key in compact_json for key in keys)  # type: ignore[operator]


def check_alternatives(schema: dict[str, Any]) -> int:
    """Raise ValueError when `schema` intersects too much (see the module); return its intersection weight.
    Call it on a schema already bounded in size and depth (wire/response_format.py `check_schema_bounds`)."""
    counted: dict[int, int] = {}
    counting: set[int] = set()
    weight = 0

    def alternatives(node: Any, hops: int, length: int) -> int:
        nonlocal weight
        if not isinstance(node, dict):
            return 1
        if (known := counted.get(id(node))) is not None:
            return known
        if id(node) in counting:
            return 1
        if length > MAX_PATH_LENGTH:
            raise ValueError(f"the schema nests more than {MAX_PATH_LENGTH} subschemas and references deep")
        counting.add(id(node))
        factors = []
        for key in _ALTERNATIVES:
            if isinstance(branches := node.get(key), list) and branches:
                factors.append(sum(alternatives(b, hops, length + 1) for b in branches))
        if isinstance(branches := node.get("allOf"), list) and branches:
            factors += [alternatives(b, hops, length + 1) for b in branches]
        if "$ref" in node:
            if hops >= MAX_REFERENCE_HOPS:
                raise ValueError(f"the schema follows more than {MAX_REFERENCE_HOPS} references on one path")
            factors.append(alternatives(resolve_ref(schema, node["$ref"]), hops + 1, length + 1))
        own = math.prod(factors)
        if sum(f > 1 for f in factors) >= 2:  # an intersection: its sides' alternatives meet
            if own > MAX_INTERSECTED_ALTERNATIVES:
                raise ValueError(f"the schema intersects {own} alternatives at one node (allOf branches, anyOf beside "
                                 f"oneOf, or a $ref beside them); at most {MAX_INTERSECTED_ALTERNATIVES} are allowed")
            weight += own
            if weight > MAX_INTERSECTION_WEIGHT:
                raise ValueError(f"the schema's intersections add up to more than {MAX_INTERSECTION_WEIGHT} "
                                 f"alternatives; at most {MAX_INTERSECTION_WEIGHT} are allowed")
        inner = 1
        for key, value in node.items():
            if key in _SKIPPED:
                continue
            for child in value.values() if isinstance(value, dict) and key in _MAPS else \
                    value if isinstance(value, list) else (value,):
                inner = max(inner, alternatives(child, hops, length + 1))
        counting.discard(id(node))
        total = counted[id(node)] = min(own * inner, MAX_INTERSECTED_ALTERNATIVES ** 2)  # past any bound: enough
        return total

    alternatives(schema, 0, 0)
    return weight


def resolve_ref(root: dict[str, Any], ref: Any) -> Any:
    """The subschema a local JSON pointer names (RFC 6901 in a URI fragment: percent-decoded, then ~1 and ~0)."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise ValueError(f"the schema's $ref {str(ref)[:80]!r} does not point inside it (a JSON pointer: #/...)")
    node: Any = root
    for token in ref[2:].split("/") if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise ValueError(f"the schema's $ref {ref[:80]!r} points to nothing in it")
    return node
