"""The meaning check's int8 products, exact on every x86 CPU (issue 21: a decision must not depend on the CPU).

The model is dynamically quantized: each linear layer is a `MatMulInteger` of activations quantized at run time
(uint8) and int8 weights. ONNX Runtime's CPU kernels compute uint8 x int8 exactly where the CPU has VNNI
(`vpdpbusd` adds the four products into 32 bits); without it (AVX2, AVX-512 without VNNI) they use `vpmaddubsw`,
which adds each pair of products into 16 bits with saturation, so a pair of large activations on large weights is
clipped (ORT's documentation on quantization warns of it). On an AMD Zen 3 (AVX2 only) that moved the margins enough
to serve "How do I convert an integer to a string in Python?" the answer cached for "How do I convert a string to
an integer in Python?" (tests/gateway/test_cache_api.py), which the calibration machine (VNNI) refuses: the accept
margin was calibrated on exact products.

`unsigned_weights` rewrites each such layer to uint8 x uint8 with the same integers: weight w + 128 with zero point
z + 128, so (w + 128) - (z + 128) = w - z, every product and sum the same. ORT computes uint8 x uint8 by widening to
16 bits before multiplying (`vpmaddwd`: 32-bit sums), which never saturates, so the layer's int32 results are the
exact ones on any CPU, the same as the VNNI path's; the rest of the graph is unchanged. It is applied only where the
CPU lacks VNNI (`exact_here`): with VNNI the int8 weights are already exact and their kernel is the faster.
tests/cache/test_nli_int8.py checks both paths against exact integer products.

What it changes, `python -m bench.meaning_threshold` (BENCHMARKS.md, "Session 44"), on the Zen 3: the calibration
rule, run on the graph as it was, found the margin 0.65 (edits let through 0.7%, training paraphrases accepted
0.0%: saturated, the model told nothing apart); on the exact graph, -1.25 (1.7%, 84.0%), near the VNNI machines'
-1.35 (2.0%, 86.5%). Not to the digit: the graph's other operations are fp32, rounded by each CPU's kernels, and
the activations' per-tensor int8 scales can amplify such a difference; the products themselves are exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

_VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # Linux's /proc/cpuinfo names


def cpu_has_vnni(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies uint8 by int8 exactly in ORT (VNNI); False where it cannot be told (not Linux):
    the exact path is then taken, slower at worst."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return not _VNNI_FLAGS.isdisjoint(line.split(":", 1)[1].split())
    except OSError:
        pass
    return False


def exact_here(model: onnx.ModelProto) -> int:
    """`unsigned_weights` where this CPU lacks VNNI; the number of layers rewritten (0 with VNNI)."""
    return 0 if cpu_has_vnni() else unsigned_weights(model)


def unsigned_weights(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every `MatMulInteger` whose weights (input B) are an int8 initializer with an int8 zero
    point initializer (or none: zero) to uint8 weights shifted by 128 with their zero point shifted alike: the same
    integer products, computed without saturation. Returns how many were rewritten; others are left as they are."""
    initializers = {init.name: init for init in model.graph.initializer}
    used = {name: 0 for name in initializers}
    for node in model.graph.node:
        for name in node.input:
            if name in used:
                used[name] += 1
    rewritten = 0
    for node in model.graph.node:
        if node.op_type != "MatMulInteger" or len(node.input) < 2:
            continue
        weights = initializers.get(node.input[1])
        zero_name = node.input[3] if len(node.input) > 3 else ""
        zero = initializers.get(zero_name) if zero_name else None
        if (weights is None or weights.data_type != TensorProto.INT8 or used[weights.name] != 1
                or (zero_name and (zero is None or zero.data_type != TensorProto.INT8 or used[zero_name] != 1))):
            continue  # not this model's shape of a quantized layer, or shared with another node: left alone
        weights.CopyFrom(numpy_helper.from_array(_shifted(numpy_helper.to_array(weights)), weights.name))
        shifted_zero = _shifted(numpy_helper.to_array(zero) if zero is not None else np.zeros((), np.int8))
        if zero is not None:
            zero.CopyFrom(numpy_helper.from_array(shifted_zero, zero.name))
        else:
            name = f"{weights.name}_unsigned_zero_point"
            model.graph.initializer.append(numpy_helper.from_array(shifted_zero, name))
            while len(node.input) < 3:
                node.input.append("")  # the activations' zero point: absent, zero
            node.input.append(name)
        rewritten += 1
    return rewritten


def _shifted(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.int16) + 128).astype(np.uint8)
