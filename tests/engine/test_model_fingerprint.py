"""The model version (engine/launch.py `model_version`) scopes the cache: it changes whenever what the model answers
could, weights of the same size and an edited chat template included, and stays put for the same model."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import engine.weight_digest as weight_digest
from engine.launch import model_version
from engine.weight_digest import RECORD

CONFIG = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 256}'


def weights(seed: int) -> bytes:
    """4,000 bytes of float32 weights: the same size for every seed, other bytes."""
    return np.random.default_rng(seed).standard_normal(1000).astype(np.float32).tobytes()


def model_dir(root: Path, name: str, *, seed: int = 1, template: str = "{{ messages }}",
              tokenizer: str = '{"model": {"vocab": {"a": 0}}}', generation: str = '{"eos_token_id": 2}') -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(CONFIG)
    (d / "model.safetensors").write_bytes(weights(seed))
    (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer.json").write_text(tokenizer)
    (d / "generation_config.json").write_text(generation)
    return d


def version(d: Path) -> str:
    return model_version(d, dtype="float32", quantize=None)


def test_other_weights_of_the_same_size_and_another_template_are_another_version(tmp_path: Path) -> None:
    v1 = model_dir(tmp_path, "student_v1", seed=1, template="{{ messages }}")
    v2 = model_dir(tmp_path, "student_v2", seed=2, template="SYSTEM: be terse {{ messages }}")
    assert (v1 / "model.safetensors").stat().st_size == (v2 / "model.safetensors").stat().st_size
    assert version(v1) != version(v2)


@pytest.mark.parametrize("changed", [{"seed": 2}, {"template": "SYSTEM: be terse {{ messages }}"},
                                     {"tokenizer": '{"model": {"vocab": {"b": 0}}}'},
                                     {"generation": '{"eos_token_id": 3}'}])
def test_each_file_that_shapes_answers_counts(tmp_path: Path, changed: dict[str, object]) -> None:
    assert version(model_dir(tmp_path, "a")) != version(model_dir(tmp_path, "b", **changed))  # type: ignore[arg-type]


def test_the_same_model_keeps_its_version_wherever_it_lies(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "m")
    first = version(d)
    assert version(d) == first
    copy = tmp_path / "copy"
    shutil.copytree(d, copy, ignore=shutil.ignore_patterns(RECORD))  # another host's copy: other mtimes, same bytes
    assert version(copy) == first


def test_the_weights_are_hashed_once_then_checked_by_size_and_mtime(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    d = model_dir(tmp_path, "m")
    first = version(d)
    assert (d / RECORD).is_file()

    def never(path: Path) -> str:
        raise AssertionError(f"{path} hashed again although unchanged")

    with monkeypatch.context() as m:
        m.setattr(weight_digest, "_file_sha256", never)
        assert version(d) == first
    # retrained in place: same name, same size, new bytes (a write moves the mtime)
    path = d / "model.safetensors"
    before = path.stat().st_mtime_ns
    path.write_bytes(weights(7))
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))
    assert version(d) != first


def test_weights_copied_over_with_the_old_mtime_are_hashed_again(tmp_path: Path) -> None:
    """`cp -p` (or rsync -a) of other weights of the same size that happen to keep the recorded mtime."""
    d = model_dir(tmp_path, "m")
    first = version(d)
    path = d / "model.safetensors"
    kept = path.stat().st_mtime_ns
    time.sleep(0.05)  # past the filesystem's coarse clock tick, so the write's ctime is another than the record's
    path.write_bytes(weights(7))
    os.utime(path, ns=(kept, kept))
    assert path.stat().st_mtime_ns == kept
    assert version(d) != first
