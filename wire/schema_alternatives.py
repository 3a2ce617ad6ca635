"""How many alternatives a JSON Schema's `allOf`s make a grammar compiler intersect, bounded before it compiles.

A grammar compiler reads `allOf` as an intersection: each branch's alternatives (`anyOf`, `oneOf`) meet every other
branch's, so the work multiplies. Measured with llguidance (our engines' compiler, engine/grammar.py) on one core,
`allOf` of k branches each `anyOf` 5 string patterns: k = 2 1.7 ms, 3 9.6 ms, 4 62 ms, 5 0.42 s, 6 2.6 s, and the
last fails at the end ("grammar too big") after its parser limits let it run. A 1.4 KB schema could take 2.6 s of an
engine's CPU for every request that sent it, and a new letter in a pattern made each one new.

`check_alternatives` counts, for every `allOf`, the product of its branches' alternatives, and refuses a schema
where it passes MAX_INTERSECTED_ALTERNATIVES (256: about 25 ms of compiling at worst by the figures above). A
node's alternatives: the sum over its `anyOf`/`oneOf` entries, times the product over its `allOf` branches, times
what a local `$ref` points to, times the most that any of its other subschemas (properties, items...) holds, since
two branches' objects meet property by property. The count errs high (two branches' different properties never
meet), which refuses some schemas a compiler would take quickly: a schema that needs more states it plainly.
One pass, each node counted once (remembered by identity); a reference back to a node being counted adds
nothing (compilers do not expand recursion); references may chain at most MAX_REFERENCE_DEPTH deep.
"""

from __future__ import annotations

import math
from typing import Any

MAX_INTERSECTED_ALTERNATIVES = 256
MAX_REFERENCE_DEPTH = 64  # nested subschemas and `$ref` hops together, on one path from the root
_ALTERNATIVES = ("anyOf", "oneOf")
_DEFINITIONS = ("$defs", "definitions")


def check_alternatives(schema: dict[str, Any]) -> None:
    """Raise ValueError when an `allOf` of `schema` intersects more than MAX_INTERSECTED_ALTERNATIVES alternatives.
    Call it on a schema already bounded in size and depth (wire/response_format.py `check_schema_bounds`)."""
    counted: dict[int, int] = {}
    counting: set[int] = set()

    def resolve(ref: Any) -> Any:
        """A local reference's target (#/$defs/x, #/definitions/x), or None."""
        if not isinstance(ref, str):
            return None
        for section in _DEFINITIONS:
            prefix = f"#/{section}/"
            if ref.startswith(prefix) and isinstance(defs := schema.get(section), dict):
                return defs.get(ref[len(prefix):])
        return None

    def alternatives(node: Any, depth: int) -> int:
        if not isinstance(node, dict):
            return 1
        if (known := counted.get(id(node))) is not None:
            return known
        if id(node) in counting:
            return 1
        if depth > MAX_REFERENCE_DEPTH:
            raise ValueError(f"the schema's subschemas and references nest more than {MAX_REFERENCE_DEPTH} deep")
        counting.add(id(node))
        total = 1
        for key in _ALTERNATIVES:
            if isinstance(branches := node.get(key), list) and branches:
                total *= sum(alternatives(b, depth + 1) for b in branches)
        if isinstance(branches := node.get("allOf"), list) and branches:
            met = math.prod(alternatives(b, depth + 1) for b in branches)
            if met > MAX_INTERSECTED_ALTERNATIVES:
                raise ValueError(f"an allOf of the schema intersects {met} alternatives of its branches' anyOf/oneOf; "
                                 f"at most {MAX_INTERSECTED_ALTERNATIVES} are allowed")
            total *= met
        if "$ref" in node:
            total *= alternatives(resolve(node["$ref"]), depth + 1)
        inner = 1
        for key, value in node.items():
            if key in ("allOf", "$ref", *_ALTERNATIVES, *_DEFINITIONS):
                continue
            for child in value.values() if isinstance(value, dict) and key in _MAPS else \
                    value if isinstance(value, list) else (value,):
                inner = max(inner, alternatives(child, depth + 1))
        counting.discard(id(node))
        counted[id(node)] = total = total * inner
        if total > MAX_INTERSECTED_ALTERNATIVES ** 2:  # past any product an allOf could still take: stop early
            total = counted[id(node)] = MAX_INTERSECTED_ALTERNATIVES ** 2
        return total

    alternatives(schema, 0)


# keywords whose value maps names to subschemas (the others hold one subschema, or a list of them)
_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas"})
