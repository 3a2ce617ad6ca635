"""`tiergate router …`: train the difficulty predictor that `auto` routing reads."""

from __future__ import annotations

from pathlib import Path

import click

from gateway.cli.options import THREADS, data_dir_option, settings_from, writable_file


@click.group()
def router() -> None:
    """The cost-aware router's difficulty predictor."""


@router.command("train")
@click.option("--prompts", "num_prompts", default=400, show_default=True, type=click.IntRange(2),
              help="ShareGPT first turns (training split) to run through every tier.")
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(1),
              help="Greedy answer length per tier and prompt.")
@click.option("--max-prompt-tokens", default=256, show_default=True, type=click.IntRange(8),
              help="Prompts are cut to this many tokens, so every tier reads the same text.")
@click.option("--tiers", "tier_names", default=None,
              help="Comma list of tiers to train on, e.g. small,mid,full [default: every local tier built]; "
                   "the reference tier (full) is always run.")
@click.option("--reference", default=None, help="The tier fidelity is measured against [default: full].")
@click.option("--out", type=click.Path(path_type=Path), default=None, callback=writable_file,
              help="Where the artifact goes [default <data dir>/router/difficulty.json, which the gateway loads].")
@click.option("--seed", default=0, show_default=True, type=int, help="Which training prompts are picked.")
@click.option("--work-dir", type=click.Path(path_type=Path), default=None,
              help="Cache of answers and scores, so re-runs only compute what is missing "
                   "[default <data dir>/router/work].")
@click.option("--threads", default=None, type=THREADS, help="torch threads [default: torch's choice].")
@click.option("--batch", "max_num_seqs", default=32, show_default=True, type=click.IntRange(1),
              help="Sequences each engine generates at once.")
@click.option("--catalogue", "tiers_file", type=click.Path(path_type=Path, exists=True), default=None,
              help="Tier catalogue [env TIERGATE_TIERS_FILE; default tiers/tiers.yaml].")
@click.option("--models-dir", type=click.Path(path_type=Path), default=None,
              help="Prepared models [env TIERGATE_MODELS_DIR; default <data dir>/models].")
@click.option("--if-missing", is_flag=True,
              help="Build the default artifact only if it is absent or stale (what `tiergate serve` runs on first "
                   "use, with its own prompt count); a second process waits for the first instead of repeating it.")
@data_dir_option
def train(if_missing: bool, num_prompts: int, max_tokens: int, max_prompt_tokens: int, tier_names: str | None,
          reference: str | None, out: Path | None, seed: int, work_dir: Path | None, threads: int | None,
          max_num_seqs: int,
          tiers_file: Path | None, models_dir: Path | None, data_dir: Path | None) -> None:
    """Train the difficulty predictor `auto` routing uses.

    Runs --prompts ShareGPT first turns (never the held-out 10% that bench/router.py evaluates on) through
    every built local tier with our engine (greedy, --max-tokens tokens), scores each cheaper tier's answer
    against the reference tier's (0.5 x MiniLM similarity of the answers + 0.5 x teacher-forced top-1
    agreement on the reference's tokens), and fits one ridge regression per cheaper tier from the prompt's
    MiniLM embedding and simple features (length, turns, code, script, request type) to that fidelity.
    From the same answers it calibrates the cascade: per cheaper tier, a confidence head on its own
    log-probabilities with thresholds per quality floor, and per tier pair a stop at a divergence risk (the
    token at which a non-streamed cheap answer is cut and retried on the dearer tier; kept only where it
    saves on the training answers at tiers.yaml's prices). A tier whose model is not built yet (small,
    before `tiergate models distill`) is skipped.

    The artifact is versioned; the gateway loads it at start-up. Time on 2 CPU cores at 48 tokens: roughly
    2 to 3 minutes per 100 prompts for each tier's answers (int8 is slower, a small student faster), plus
    about a minute per 100 prompts to score each cheaper tier. Answers and scores are cached in --work-dir,
    so a re-run (or bench/router.py on the same prompts) only computes what is missing.
    """
    from gateway.config_files import ConfigFileError, load_yaml
    from tiers.catalogue import TierCatalogue
    from tiers.difficulty import default_artifact_path
    from training.router_training import RouterTrainingError, ensure_difficulty_model
    from training.router_training import train as train_model

    settings = settings_from(data_dir=data_dir, models_dir=models_dir, tiers_file=tiers_file)
    try:
        catalogue = load_yaml(settings.tiers_file, TierCatalogue)
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from exc
    names = [t.strip() for t in tier_names.split(",") if t.strip()] if tier_names else None
    out = out or default_artifact_path(settings.data_dir)
    try:
        if if_missing:
            out = ensure_difficulty_model(settings.data_dir, settings.resolved_models_dir, catalogue, threads=threads,
                                          echo=lambda msg: click.echo(msg, err=True))
            click.echo(f"ready: {out}")
            return
        train_model(catalogue, settings.resolved_models_dir, out, num_prompts=num_prompts, max_tokens=max_tokens,
                    max_prompt_tokens=max_prompt_tokens, seed=seed, tiers=names, reference=reference,
                    work_dir=work_dir or settings.data_dir / "router" / "work", threads=threads,
                    max_num_seqs=max_num_seqs, progress=True, echo=lambda msg: click.echo(msg, err=True))
    except RouterTrainingError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"ready: {out}")
