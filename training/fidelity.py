"""How faithful a cheaper tier's answer is to the reference (`full`) tier's answer: a number in [0, 1].

    fidelity = 0.5 · semantic + 0.5 · agreement

- semantic: cosine similarity of the two answers' all-MiniLM-L6-v2 embeddings, rescaled so that two
  unrelated texts score about 0: (cos − 0.05) / 0.95, clipped to [0, 1]. 0.05 is the median cosine of
  unrelated ShareGPT texts (200 first turns, all pairs: median 0.05, 95th percentile 0.23), so an answer on
  another subject earns nothing while a paraphrase keeps most of its score. It judges *what* was said and
  forgives wording, but alone it is generous to a fluent answer on the right topic that gets the facts wrong.
- agreement: teacher-forced top-1 agreement. The cheaper tier's model reads the prompt followed by the
  full tier's answer, and we count the answer positions where its most likely next token is the token the
  full tier produced (the end-of-sequence token included when the full tier stopped by itself). It is
  strict where the embedding is lenient (a different number, a dropped negation, a wrong name all cost
  tokens), needs one forward pass per answer instead of a generation, and does not suffer from the
  compounding of greedy decoding: one early different word makes two greedy answers diverge textually
  even when the cheaper model would have said the same thing afterwards.

Equal weights because neither view dominates: agreement is a token-level proxy for "would have said the
same thing", the embedding is a meaning-level proxy for "said something equivalent". The reference tier's
own fidelity is 1.0 by definition. Both parts are deterministic (greedy answers, fixed models).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from assets import offline_hub

EMBED_FLOOR = 0.05  # the median cosine similarity of unrelated texts under all-MiniLM-L6-v2 (see above)
SEMANTIC_WEIGHT = 0.5


def semantic_similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise rescaled cosine of two [N, D] matrices of L2-normalized embeddings, in [0, 1]."""
    cos = np.sum(np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64), axis=-1)
    return np.clip((cos - EMBED_FLOOR) / (1.0 - EMBED_FLOOR), 0.0, 1.0)


def combine(semantic: np.ndarray | float, agreement: np.ndarray | float) -> np.ndarray:
    """The fidelity score from its two parts (each in [0, 1])."""
    s = np.clip(np.asarray(semantic, dtype=np.float64), 0.0, 1.0)
    g = np.clip(np.asarray(agreement, dtype=np.float64), 0.0, 1.0)
    return SEMANTIC_WEIGHT * s + (1.0 - SEMANTIC_WEIGHT) * g


def answer_fidelity(cheap_answers: Sequence[str], reference_answers: Sequence[str],
                    agreements: Sequence[float], embedder: Any) -> np.ndarray:
    """Fidelity per answer pair. `embedder.encode(texts)` returns normalized rows (cache/embedder.py's
    Embedder). Two empty answers are identical (semantic 1); one empty answer against a non-empty one
    shares nothing (semantic 0)."""
    if not (len(cheap_answers) == len(reference_answers) == len(agreements)):
        raise ValueError("cheap answers, reference answers and agreements must have the same length")
    n = len(cheap_answers)
    if n == 0:
        return np.zeros(0)
    emb = embedder.encode([*cheap_answers, *reference_answers])
    semantic = semantic_similarity(emb[:n], emb[n:])
    for i, (c, r) in enumerate(zip(cheap_answers, reference_answers, strict=True)):
        if not c.strip() or not r.strip():
            semantic[i] = 1.0 if c.strip() == r.strip() else 0.0
        elif c == r:
            semantic[i] = 1.0  # exactly the same answer: no rounding below 1
    return combine(semantic, np.asarray(agreements, dtype=np.float64))


# ---- teacher-forced agreement (torch) ----

def load_scoring_model(model_dir: Path, *, dtype: str = "auto", quantize: str | None = None,
                       device: str = "cpu") -> Any:
    """The tier's model as transformers loads it, in the precision and quantization its engine uses, so
    the agreement measures the tier as served (our engine's greedy output equals transformers')."""
    offline_hub()
    from transformers import AutoModelForCausalLM

    from engine.model_runner import resolve_dtype
    from engine.quantize import quantize_int8_

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, device, quantize))
    if quantize == "int8":
        quantize_int8_(model)
    elif quantize is not None:
        raise ValueError(f"unknown quantization {quantize!r}")
    return model.to(device).eval()


def teacher_forced_agreement(model: Any, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *,
                             batch_size: int = 8, progress: Any = None) -> list[float]:
    """For each (prompt ids, answer ids): the fraction of answer tokens that are `model`'s top-1 choice
    given the prompt and the answer so far. One forward pass per pair, batched with right padding (causal
    attention never looks at the padding to the right). An empty answer agrees trivially (1.0)."""
    import torch

    out = [1.0] * len(prompts)
    todo = [i for i in range(len(prompts)) if len(answers[i]) > 0]
    todo.sort(key=lambda i: len(prompts[i]) + len(answers[i]))  # similar lengths together: less padding
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            seqs = [list(prompts[i]) + list(answers[i]) for i in batch]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for row, s in enumerate(seqs):
                ids[row, :len(s)] = torch.tensor(s)
                mask[row, :len(s)] = 1
            # the head only where an answer token is predicted: full logits would be [B, T, vocab]
            hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            head = model.get_output_embeddings()
            for row, i in enumerate(batch):
                p, a = len(prompts[i]), len(answers[i])
                predicted = head(hidden[row, p - 1:p + a - 1]).argmax(dim=-1).cpu()  # position t predicts t + 1
                out[i] = float((predicted == torch.tensor(list(answers[i]))).float().mean())
            if progress is not None:
                progress.update(len(batch))
    return out
