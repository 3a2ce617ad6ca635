"""The meaning check's model reads only the relative positions a pair can have (issue 21: its time a candidate).

DeBERTa's disentangled attention scores each token against every relative position of its table (here 512: -256 to
+255) in two products a layer ("content to position" and "position to content"), then keeps, for each pair of
tokens, the one entry of their distance (GatherElements). A pair of L tokens has distances -(L-1) to L-1 only, and
the model's log buckets never map a distance to a larger one, so for a 25-token pair 49 of the 512 columns are read
and the rest is computed for nothing: the two products and the tiling of the table before them were about a third
of a pass (ORT's profiler, one Zen 4 core: 7.8 of 32 ms in those products, 2.3 ms tiling).

`narrow_relative_positions` rewrites the graph so each product uses only the table's rows from span - L + 1 to
span + L - 1 (clamped to the table) and the gather's indices move down by the same offset. The entries kept are the
same dot products of the same rows, so the scores do not change (tests/cache/test_nli_positions.py compares the two
graphs' logits, bit for bit, on pairs of every length up to the model's limit). The pattern is matched by its shape
(GatherElements of MatMul(x, Transpose(Tile(Expand(table)))) with a [heads, 2 * span, size] table), which is
DeBERTa's and is checked only against this model: a graph without it is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference


@dataclass(frozen=True)
class _Product:
    table: str  # the relative-position table [heads, 2 * span, head size], before it is expanded and tiled
    expand: onnx.NodeProto  # takes the table
    gather: onnx.NodeProto  # keeps each token pair's entry of the product


def narrow_relative_positions(model: onnx.ModelProto, input_name: str = "input_ids") -> int:
    """Rewrite `model` in place; returns how many position products were narrowed (0: the graph is unchanged)."""
    graph = model.graph
    products = _products(model)
    spans = {span for span, _ in products}
    if not products or len(spans) != 1 or input_name not in {i.name for i in graph.input}:
        return 0
    span = spans.pop()

    def name(what: str) -> str:
        return f"tiergate_narrow/{what}"

    for what, value in (("one", 1), ("two", 2), ("span_plus_one", span + 1), ("span", span), ("zero", 0)):
        graph.initializer.append(numpy_helper.from_array(np.array([value], dtype=np.int64), name(what)))
    shared = [  # first = max(span + 1 - L, 0), end = span + L, for the pair's length L
        helper.make_node("Shape", [input_name], [name("shape")]),
        helper.make_node("Slice", [name("shape"), name("one"), name("two")], [name("length")]),
        helper.make_node("Sub", [name("span_plus_one"), name("length")], [name("first_unclamped")]),
        helper.make_node("Max", [name("first_unclamped"), name("zero")], [name("first")]),
        helper.make_node("Add", [name("span"), name("length")], [name("end")]),
    ]
    nodes = list(graph.node)
    before: dict[int, list[onnx.NodeProto]] = {}
    for i, (_, product) in enumerate(products):
        rows, index = name(f"rows_{i}"), name(f"index_{i}")
        before.setdefault(id(product.expand), []).append(  # the table's axis 1: its positions
            helper.make_node("Slice", [product.table, name("first"), name("end"), name("one")], [rows]))
        before.setdefault(id(product.gather), []).append(
            helper.make_node("Sub", [product.gather.input[1], name("first")], [index]))
        product.expand.input[0] = rows
        product.gather.input[1] = index
    rewritten = shared + [new for node in nodes for new in (*before.get(id(node), ()), node)]
    del graph.node[:]
    graph.node.extend(rewritten)
    return len(products)


def _products(model: onnx.ModelProto) -> list[tuple[int, _Product]]:
    """GatherElements(MatMul(x, Transpose(Tile(Expand(table)))), index) with a [heads, 2 * span, size] table."""
    graph = model.graph
    made = {out: node for node in graph.node for out in node.output}
    inferred = shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    found = []
    for gather in graph.node:
        if gather.op_type != "GatherElements":
            continue
        chain, name = [], gather.input[0]
        for op in ("MatMul", "Transpose", "Tile", "Expand"):
            node = made.get(name)
            if node is None or node.op_type != op:
                break
            chain.append(node)
            name = node.input[1] if op == "MatMul" else node.input[0]
        if len(chain) != 4:
            continue
        expand = chain[-1]
        shape = shapes.get(expand.input[0], [])
        if len(shape) == 3 and shape[1] >= 2 and shape[1] % 2 == 0:
            found.append((shape[1] // 2, _Product(expand.input[0], expand, gather)))
    return found
