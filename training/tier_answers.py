"""Which tiers can answer, and their answers, cached (steps 2 and 3 of training/router_training.py).

Every prepared local tier answers every prompt greedily in an in-process engine; a cheaper tier's answers are
then scored by teacher-forced top-1 agreement on the reference tier's tokens. Both are cached per tier
fingerprint (its engine's model version plus its weight files) in append-only JSON-lines files under a work
directory, so re-runs and the benchmark only compute what is missing, and an interrupted run keeps its work.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assets import offline_hub
from assets.model_source import is_prepared, resolve_model
from tiers.catalogue import TierCatalogue, TierSpec
from training.router_prompts import RouterTrainingError, chat_prompt_ids, conversation, prompt_key

log = logging.getLogger("tiergate.router")


def reference_tier(catalogue: TierCatalogue, reference: str | None = None) -> str:
    """`full` when the catalogue has it, else its dearest tier."""
    if reference:
        if reference not in catalogue.tiers:
            raise RouterTrainingError(f"no tier {reference!r} in the catalogue")
        return reference
    return "full" if "full" in catalogue.tiers else catalogue.by_price()[-1].name


def runnable_tiers(catalogue: TierCatalogue, models_dir: Path, wanted: Sequence[str] | None = None
                   ) -> tuple[list[TierSpec], dict[str, str]]:
    """The local tiers whose models are built, cheapest first, and why each other wanted tier is skipped."""
    names = list(wanted) if wanted else list(catalogue.tiers)
    unknown = [n for n in names if n not in catalogue.tiers]
    if unknown:
        raise RouterTrainingError(f"unknown tier(s) {', '.join(unknown)}; "
                                  f"the catalogue has {', '.join(catalogue.tiers)}")
    ready, skipped = [], {}
    for spec in catalogue.by_price():
        if spec.name not in names:
            continue
        if spec.backend != "local":
            skipped[spec.name] = "a remote tier: training runs local engines only"
        elif not is_prepared(spec.model, models_dir):
            how = spec.prepared_by or f"tiergate models fetch --model {spec.model}"
            skipped[spec.name] = f"its model {spec.model!r} is not built yet (build it with `{how}`)"
        else:
            ready.append(spec)
    return ready, skipped


def tier_model_dir(spec: TierSpec, models_dir: Path) -> Path:
    return resolve_model(spec.model, models_dir)


def tier_version(spec: TierSpec, models_dir: Path) -> str:
    """The model version the tier's engine reports (weights, precision, quantization, engine)."""
    from engine.launch import model_version
    from engine.model_runner import resolve_dtype

    dtype = str(resolve_dtype(spec.dtype, spec.device, spec.quantize)).removeprefix("torch.")
    return model_version(tier_model_dir(spec, models_dir), dtype=dtype, quantize=spec.quantize,
                         kv_cache_dtype=spec.kv_cache_dtype)


def tier_fingerprint(spec: TierSpec, models_dir: Path) -> str:
    """What caches and staleness checks key on: the engine's model version plus the model directory and its
    weight files' modification times. The model version alone hashes the config and the weight files' names
    and sizes, which a student distilled into the teacher's architecture shares with its teacher."""
    model_dir = tier_model_dir(spec, models_dir).resolve()
    h = hashlib.sha256(f"{tier_version(spec, models_dir)}|{model_dir}".encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:16]


# ---- answers, cached ----

@dataclass
class Answer:
    num_prompt_tokens: int
    text: str
    token_ids: list[int]  # what the tier produced, its end-of-sequence token included when it stopped
    finish_reason: str | None
    # per token, when asked: its log-probability and the top alternatives' log-probabilities, most likely first
    # (what the engine's server returns as `logprobs.content[].logprob` and `.top_logprobs`)
    logprobs: list[tuple[float, list[float]]] | None = None


class JsonlCache:
    """Records by key in an append-only JSON-lines file: an interrupted run keeps what it finished."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.records[rec["key"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by a crash
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, record: dict[str, Any]) -> None:
        record = {"key": key, **record}
        self.records[key] = record
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def _bar(total: int, desc: str, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", disable=not progress, file=sys.stderr, dynamic_ncols=True)


def generate_answers(spec: TierSpec, models_dir: Path, prompts: Sequence[str], *, max_tokens: int, work_dir: Path,
                     fingerprint: str | None = None, threads: int | None = None, max_num_seqs: int = 32,
                     progress: bool = True, top_logprobs: int | None = None) -> list[Answer]:
    """Greedy answers of `spec`'s tier to each prompt (a one-turn conversation), from the cache or from an
    in-process engine that runs up to `max_num_seqs` of them at once. With `top_logprobs` (0-20) each answer
    also has its tokens' log-probabilities and that many alternatives' (a cached answer without them, or with
    fewer alternatives, is made again: greedy, so its tokens are the same)."""
    fingerprint = fingerprint or tier_fingerprint(spec, models_dir)
    cache = JsonlCache(work_dir / "generations" / f"{spec.name}-{fingerprint}-t{max_tokens}.jsonl")

    def usable(key: str) -> bool:
        rec = cache.records.get(key)
        return rec is not None and (top_logprobs is None or int(rec.get("top_logprobs", -1)) >= top_logprobs)

    missing = [p for p in dict.fromkeys(prompts) if not usable(prompt_key(p))]
    if missing:
        from engine.launch import build_engine
        from engine.llm_engine import EngineInputError
        from engine.sampling_params import SamplingParams

        engine, _ = build_engine(spec.model, models_dir, dtype=spec.dtype, quantize=spec.quantize,
                                 device=spec.device, max_num_seqs=max_num_seqs, threads=threads or spec.threads,
                                 kv_cache_bytes=spec.kv_cache_bytes, kv_cache_dtype=spec.kv_cache_dtype)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top_logprobs)
        bar = _bar(len(missing), f"generate {spec.name}", progress)

        async def one(prompt: str) -> None:
            ids = chat_prompt_ids(engine.tokenizer, conversation(prompt))
            text, tokens, lps, last = [], [], [], None
            try:
                async for out in engine.generate(ids, params):
                    text.append(out.text)
                    tokens += out.token_ids
                    lps += [[round(lp, 5), [round(v, 5) for _, v in top]] for lp, top in out.logprobs or ()]
                    last = out
            except EngineInputError as exc:  # cannot happen with truncated prompts; keep the run going
                log.warning("tier %s refused a prompt: %s", spec.name, exc)
            record: dict[str, Any] = {"num_prompt_tokens": len(ids), "text": "".join(text), "token_ids": tokens,
                                      "finish_reason": last.finish_reason if last else "error"}
            if top_logprobs is not None:
                record |= {"top_logprobs": top_logprobs, "logprobs": lps}
            cache.add(prompt_key(prompt), record)
            bar.update(1)

        async def run_all() -> None:
            await asyncio.gather(*(one(p) for p in missing))

        engine.start()
        try:
            asyncio.run(run_all())
        finally:
            engine.shutdown()
            bar.close()
    answers = []
    for p in prompts:
        rec = cache.records[prompt_key(p)]
        lps = [(float(lp), [float(v) for v in top]) for lp, top in rec["logprobs"]] if "logprobs" in rec else None
        answers.append(Answer(rec["num_prompt_tokens"], rec["text"], list(rec["token_ids"]), rec["finish_reason"],
                              lps))
    return answers


def agreement_scores(spec: TierSpec, models_dir: Path, prompts: Sequence[str], reference_answers: Sequence[Answer],
                     *, reference_spec: TierSpec, reference_fingerprint: str, max_tokens: int, work_dir: Path,
                     fingerprint: str | None = None, progress: bool = True) -> list[float]:
    """Teacher-forced top-1 agreement of `spec`'s model on the reference tier's answers (cached)."""
    fingerprint = fingerprint or tier_fingerprint(spec, models_dir)
    name = f"{spec.name}-{fingerprint}-vs-{reference_fingerprint}-t{max_tokens}.jsonl"
    cache = JsonlCache(work_dir / "agreement" / name)
    missing = [i for i, p in enumerate(prompts) if prompt_key(p) not in cache.records]
    if missing:
        offline_hub()
        from transformers import AutoTokenizer

        from training.fidelity import load_scoring_model, teacher_forced_agreement

        model_dir = tier_model_dir(spec, models_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ref_tok = AutoTokenizer.from_pretrained(tier_model_dir(reference_spec, models_dir))
        same_vocab = tok.get_vocab() == ref_tok.get_vocab()
        prompt_ids, answer_ids = [], []
        for i in missing:
            ans = reference_answers[i]
            prompt_ids.append(chat_prompt_ids(tok, conversation(prompts[i])))
            if same_vocab:
                answer_ids.append(ans.token_ids)  # the very tokens the reference produced
            else:  # another vocabulary: its tokens for the same text, and its own end of sequence
                ids = list(tok(ans.text, add_special_tokens=False)["input_ids"])
                if ans.finish_reason == "stop" and tok.eos_token_id is not None:
                    ids.append(tok.eos_token_id)
                answer_ids.append(ids)
        model = load_scoring_model(model_dir, dtype=spec.dtype, quantize=spec.quantize, device=spec.device)
        bar = _bar(len(missing), f"score {spec.name}", progress)
        try:
            scores = teacher_forced_agreement(model, prompt_ids, answer_ids, progress=bar)
        finally:
            bar.close()
        for i, score in zip(missing, scores, strict=True):
            cache.add(prompt_key(prompts[i]), {"agreement": score})
        del model
    return [float(cache.records[prompt_key(p)]["agreement"]) for p in prompts]
