"""The MiniLM embedder: normalized 384-d vectors, batch and single agree, meaning shows in the cosine, and ONNX
Runtime gives the torch model's vectors (or is not used)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache import Embedder, EmbedderError


def test_vectors_are_normalized_and_batch_matches_single(embedder: Embedder) -> None:
    texts = ["How do I reverse a list in Python?", "What is the capital of France?"]
    batch = embedder.encode(texts)
    assert batch.shape == (2, 384) and batch.dtype == np.float32
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert np.allclose(embedder.encode_one(texts[0]), batch[0], atol=1e-4)
    assert embedder.encode([]).shape == (0, 384)


def test_paraphrases_are_closer_than_unrelated_questions(embedder: Embedder) -> None:
    a, b, c = embedder.encode(["How do I reverse a list in Python?", "Reversing a Python list: how?",
                               "What is the boiling point of water?"])
    assert float(a @ b) > 0.8 > float(a @ c)


def test_token_counts(embedder: Embedder) -> None:
    assert embedder.max_tokens == 256
    assert embedder.num_tokens("hello world") == 4  # [CLS] hello world [SEP]


TEXTS = ["hi", "  How do I reverse a list in Python?  ", "What is the capital of France?",
         "Explain the difference between a process and a thread, with examples. " * 30]  # the last is cut at 256


def test_onnx_runtime_gives_the_torch_models_vectors() -> None:
    pytest.importorskip("onnxruntime")
    onnx, torch = Embedder(runtime="onnx"), Embedder(runtime="torch")
    together, reference = onnx.encode(TEXTS), torch.encode(TEXTS)
    assert onnx.runtime == "onnx" and torch.runtime == "torch"
    assert np.abs(together - reference).max() <= 1e-5
    alone = np.stack([onnx.encode_one(t) for t in TEXTS])  # no padding: the same vectors again
    assert float((alone * reference).sum(axis=1).min()) >= 0.99999


def test_without_onnx_runtime_auto_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from cache import onnx_runtime

    def unavailable(*args: object, **kwargs: object) -> None:
        raise onnx_runtime.OnnxUnavailable("onnxruntime is not installed")

    monkeypatch.setattr(onnx_runtime.OnnxForward, "__init__", unavailable)
    auto = Embedder(runtime="auto")
    assert auto.encode(["What is the capital of France?"]).shape == (1, 384) and auto.runtime == "torch"
    with pytest.raises(EmbedderError, match="not installed"):
        Embedder(runtime="onnx").encode_one("x")
    with pytest.raises(EmbedderError, match="unknown embedder runtime"):
        Embedder(runtime="tensorflow")  # type: ignore[arg-type]


def test_an_export_is_in_place_only_once_checked_and_a_failed_one_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written beside its place, checked there, then renamed (readable by every process of the machine); a failed
    check, or an exporter killed before (its temporary file), leaves no file to trip over."""
    import sentence_transformers

    from cache import onnx_runtime

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", lambda *args, **kwargs: "model")
    monkeypatch.setattr(onnx_runtime, "_export", lambda model, path: path.write_bytes(b"graph"))

    def differs(model: object, path: Path) -> None:
        assert path.read_bytes() == b"graph" and path.parent == tmp_path
        raise onnx_runtime.OnnxUnavailable("the ONNX export differs from the torch model")

    monkeypatch.setattr(onnx_runtime, "_check", differs)
    target = tmp_path / "minilm-abc.onnx"
    (tmp_path / f".{target.name}.killed.tmp").write_bytes(b"gra")  # a process killed mid-export
    with pytest.raises(onnx_runtime.OnnxUnavailable, match="differs"):
        onnx_runtime._export_checked(tmp_path / "model", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.lock"]
    monkeypatch.setattr(onnx_runtime, "_check", lambda model, path: None)
    onnx_runtime._export_checked(tmp_path / "model", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.lock", target.name]
    assert target.read_bytes() == b"graph" and target.stat().st_mode & 0o777 == 0o644


def test_length_groups_pad_little_and_pass_few() -> None:
    from cache.onnx_runtime import _length_groups

    lengths = [12, 200, 30, 31, 12, 29, 199, 33]
    groups = _length_groups(lengths, batch_size=64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every text once
    assert [sorted(lengths[i] for i in g) for g in groups] == [[199, 200], [29, 30, 31, 33], [12, 12]]
    assert all(lengths[g[0]] == max(lengths[i] for i in g) for g in groups)  # the first is the longest
    assert sorted(len(g) for g in _length_groups([30] * 100, batch_size=32)) == [4, 32, 32, 32]  # fewest passes
    assert _length_groups([], batch_size=32) == []
