"""MiniLM's forward pass on ONNX Runtime: the same vectors as sentence-transformers for a third of the CPU.

Measured here on one core (bench/cache_path.py, `--runtime`): a short question took 10 ms instead of 30 ms,
16 questions in one batch 150 ms instead of 220 ms, vectors within 2e-7 of torch's (cosine 0.9999996). An int8
export (dynamic quantization, per channel) was 3x faster again but moved vectors to cosine 0.98, and bf16
weights to 0.997: both change which questions match, so neither is used.

The graph (the BERT encoder, mean pooling over the attention mask, L2 normalization) is exported once per
machine from the sentence-transformers model with `torch.onnx`, checked against that model on probe
texts of several lengths, alone and padded in one batch, and only then moved into `export_dir`, named by the
model's files and the library versions. Tokenization stays sentence-transformers' own (`preprocess`), so both
runtimes read the same word pieces. Needs the `onnxruntime` and `onnx` wheels; without them, or when export or
check fails, the embedder keeps the sentence-transformers forward (see `cache.embedder`). Optimum's exporter
(sentence-transformers' `backend="onnx"`) is not used: it pins transformers below the version installed here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from assets.atomic_file import leftovers, replacing
from assets.locks import file_lock

log = logging.getLogger("tiergate.cache")

# What the exported graph must reproduce: worst cosine and largest element difference to the torch forward.
MIN_COSINE = 0.99999
MAX_ABS_DIFF = 1e-4
_PROBES = ("hi", "What is the capital of France?", "  How do I reverse a list in Python, without a copy?  ",
           "Explain, step by step and with examples, " * 40)  # the last one is cut at the model's 256 word pieces


class OnnxUnavailable(Exception):
    """ONNX Runtime cannot serve this model here (a wheel is missing, or the export or its check failed)."""


def default_export_dir() -> Path:
    """Where exports are kept: $TIERGATE_EMBEDDER_CACHE, else ~/.cache/tiergate/embedder."""
    return Path(os.environ.get("TIERGATE_EMBEDDER_CACHE") or Path.home() / ".cache" / "tiergate" / "embedder")


def export_path(model_dir: Path, export_dir: Path | None = None) -> Path:
    """Where the export of this model for these library versions is (or will be)."""
    return (export_dir or default_export_dir()) / f"minilm-{_fingerprint(model_dir)}.onnx"


class OnnxForward:
    """Texts in, normalized [N, 384] float32 vectors out, through an ONNX Runtime session. Thread-safe (ORT's
    `run` is, and releases the GIL)."""

    def __init__(self, model: Any, model_dir: Path, *, export_dir: Path | None = None,
                 num_threads: int | None = 1, export: bool = True) -> None:
        """`model` is the loaded SentenceTransformer (its tokenizer is used, and it is the export's source).
        Without `export`, only an export made before is used (OnnxUnavailable if there is none)."""
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise OnnxUnavailable("onnxruntime is not installed") from exc
        self._model = model
        path = export_path(model_dir, export_dir)
        if not path.exists():
            if not export:
                raise OnnxUnavailable(f"no export at {path} yet")
            _export_checked(model_dir, path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads or 0  # 0: ORT's default, every core
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-waiting threads
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """[N, 384] float32. Texts run in groups of similar length (`_length_groups`): a forward pass costs about
        the same per word piece, padding included (measured: 16 texts of 25 pieces 92 ms, padded to 80 pieces
        327 ms), plus 2-3 ms per pass. The texts are tokenized once, together: a group's feed is its rows of that
        feed, cut to its longest text, the same word pieces as a tokenizer call of its own (a call per group and
        one for the lengths cost 40-65 us a text more, 8-32 texts a call)."""
        feed = _feed(self._model, list(texts))  # [N, S] int64, padded to the longest text
        mask = feed["attention_mask"]
        lengths = mask.sum(axis=1).tolist()  # word pieces of each text, the special tokens too
        width = mask.shape[1]
        left = self._model.tokenizer.padding_side == "left"
        out = np.empty((len(texts), 384), dtype=np.float32)
        for group in _length_groups(lengths, batch_size):
            longest = lengths[group[0]]  # the pieces a group's own tokenizer call would have padded it to
            cols = slice(width - longest, width) if left else slice(0, longest)
            out[group] = self._session.run(None, {name: rows[group, cols] for name, rows in feed.items()})[0]
        return out


# What one more forward pass costs, in padded word pieces: the weights (~42 MB) are read once a pass whatever its
# rows. Measured on one core: 2.0 ms a pass and 0.23 ms a piece on an AMD Zen 4 (9 pieces), 2.0 and 0.105 ms on a
# Zen 5 (19), 3 ms and 0.23 ms on a Xeon (13).
PASS_PIECES = 12


def _length_groups(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices by descending length, cut into groups of at most `batch_size`, each padded to its first (longest)
    text, where the cuts make the least work: a pass costs its rows times its longest text, plus PASS_PIECES.
    Texts of 27-33 pieces padded together waste about 10% of their pass: in batches of 16 and 32, cut into 2-4
    passes, they took 10-13% less CPU (one core, AMD Zen 4); in batches of 5-11 a cut seldom pays. Linear in
    N * batch_size."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    longest = [lengths[i] for i in order]
    cost = [0] + [0] * len(order)  # cost[j]: the least work for the first j texts (in `order`)
    start = [0] * (len(order) + 1)  # where the last group of that best cut starts
    for j in range(1, len(order) + 1):
        cost[j], start[j] = min((cost[i] + PASS_PIECES + (j - i) * longest[i], i)
                                for i in range(max(0, j - batch_size), j))
    groups: list[list[int]] = []
    j = len(order)
    while j:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]


def _feed(model: Any, texts: list[str]) -> dict[str, np.ndarray]:
    """Word pieces as sentence-transformers makes them (`preprocess`, `tokenize` before version 6)."""
    features = (getattr(model, "preprocess", None) or model.tokenize)(texts)  # [B, S] int64 torch tensors
    return {"input_ids": features["input_ids"].numpy(), "attention_mask": features["attention_mask"].numpy()}


def _export_checked(model_dir: Path, target: Path) -> None:
    """Export the model to `target` and check it; a failed export leaves nothing behind. The export reads its own
    copy of the model: tracing switches the encoder's attention implementation, which a serving copy must not see."""
    from sentence_transformers import SentenceTransformer

    with file_lock(target.parent / ".export.lock"):  # one exporter per machine; the others then find its file
        if target.exists():
            return
        model = SentenceTransformer(str(model_dir), device="cpu")
        # left by a process killed mid-export (`.partial-*.onnx`: by versions before assets/atomic_file.py)
        for stale in [*leftovers(target), *target.parent.glob(".partial-*.onnx")]:
            stale.unlink(missing_ok=True)
        try:
            with replacing(target, mode=0o644) as tmp:  # every process of the machine may read it
                _export(model, tmp)
                _check(model, tmp)
        except OnnxUnavailable:
            raise
        except Exception as exc:  # torch.onnx and onnxruntime raise many kinds; any of them means "not here"
            raise OnnxUnavailable(f"exporting the embedder to ONNX failed: {exc}") from exc
    log.info("embedder exported to ONNX: %s", target)


def _fingerprint(model_dir: Path) -> str:
    """The model's files (name, size, mtime) and the versions of everything the export depends on."""
    h = hashlib.sha256()
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(model_dir)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for package in ("torch", "transformers", "sentence-transformers", "onnx", "onnxruntime"):
        try:
            h.update(f"{package}={importlib.metadata.version(package)}\n".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{package}=none\n".encode())
    return h.hexdigest()[:16]


def _export(model: Any, path: Path) -> None:
    import torch

    try:
        import onnx  # noqa: F401  (torch.onnx writes through it)
    except ImportError as exc:
        raise OnnxUnavailable("the onnx package is not installed") from exc

    encoder = model[0].auto_model
    if [type(m).__name__ for m in model] != ["Transformer", "Pooling", "Normalize"] or \
            getattr(model[1], "pooling_mode", "mean") != "mean":
        raise OnnxUnavailable(f"not a mean-pooled, normalized sentence model: {model}")

    class Pooled(torch.nn.Module):
        """Encoder, mean pooling over real tokens, L2 normalization: what the three modules compute."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, S, H]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, H]
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    feed = _feed(model, ["a first probe text", "a second, longer probe text for the export"])
    previous = encoder.config._attn_implementation
    if hasattr(encoder, "set_attn_implementation"):
        encoder.set_attn_implementation("eager")  # a traced graph with no shape-dependent branches
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on Python-level branches it saw once
            torch.onnx.export(Pooled().eval(), (torch.from_numpy(feed["input_ids"]),
                                                torch.from_numpy(feed["attention_mask"])), str(path),
                              input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                              dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                            "attention_mask": {0: "batch", 1: "tokens"}, "embedding": {0: "batch"}},
                              opset_version=17, dynamo=False)
    finally:
        if hasattr(encoder, "set_attn_implementation"):
            encoder.set_attn_implementation(previous)


def _check(model: Any, path: Path) -> None:
    """Refuse an export whose vectors differ from the torch forward's, alone or padded in a batch."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    reference = model.encode(list(_PROBES), normalize_embeddings=True, convert_to_numpy=True,
                             show_progress_bar=False).astype(np.float32)
    for texts in ([[t] for t in _PROBES] + [list(_PROBES)]):
        got = session.run(None, _feed(model, texts))[0]
        want = reference[[_PROBES.index(t) for t in texts]]
        cosine = float((got * want).sum(axis=1).min())
        if cosine < MIN_COSINE or float(np.abs(got - want).max()) > MAX_ABS_DIFF:
            raise OnnxUnavailable(f"the ONNX export differs from the torch model (cosine {cosine:.6f})")
