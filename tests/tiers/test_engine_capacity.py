"""Engines start with as many sequences as their KV cache holds for a typical request, and the gateway gives the
tier's dispatch queue the same number of slots: the gateway's reckoning (from config.json, no torch) agrees
with what the engine computes from its real KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.app import tier_capacity
from gateway.settings import Settings
from tiers import supervisor
from tiers.catalogue import TierSpec
from tiers.client import TierClient
from tiers.replica import Replica
from tiers.supervisor import EngineProcess, engine_max_num_seqs

# SmolLM2-135M's attention shape: 30 layers, 9 heads of 64, 3 KV heads
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def model_dir(tmp_path: Path, config: dict[str, int]) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def spec(model: Path | str, **fields: object) -> TierSpec:
    return TierSpec(name="full", backend="local", model=str(model), price_per_1k_input="0", price_per_1k_output="0",
                    hardware_cost_per_hour="0", context_limit=8192, **fields)


@pytest.mark.parametrize(("fields", "seqs"), [
    ({"dtype": "fp32"}, 11),  # 512 MiB / 46,080 bytes a token = 11,650 tokens: 11 requests of 1,024
    ({"dtype": "bf16"}, 22),
    ({"dtype": "fp32", "kv_cache_dtype": "bf16"}, 22),  # a bf16 cache under fp32 weights holds twice as many
    ({"dtype": "fp32", "kv_cache_bytes": 64 << 20}, 1),  # a small budget still runs one
    ({"dtype": "bf16", "kv_cache_bytes": 64 << 30}, 256),  # a huge one is capped
    ({"dtype": "fp32", "max_num_seqs": 5}, 5),  # the catalogue's own number wins
])
def test_engines_start_with_what_their_kv_cache_holds(fields: dict[str, object], seqs: int, tmp_path: Path) -> None:
    tier = spec(model_dir(tmp_path, SMOLLM2), **fields)
    engine = EngineProcess(tier, Replica("full", 0), models_dir=tmp_path, log_dir=tmp_path, client=TierClient(),
                           start_timeout_s=1)
    cmd = engine.command(9000)
    assert cmd[cmd.index("--max-num-seqs") + 1] == str(seqs)
    settings = Settings(data_dir=tmp_path / "data", models_dir=tmp_path)
    assert tier_capacity(tier, settings) == seqs  # the dispatch queue holds as many as the engine runs
    assert tier_capacity(tier.model_copy(update={"replicas": 3}), settings) == 3 * seqs


def test_a_model_not_built_yet_gets_the_old_default(tmp_path: Path) -> None:
    assert engine_max_num_seqs(spec("students/not-built"), tmp_path) == supervisor.UNSIZED_MAX_NUM_SEQS


def test_the_engine_refuses_a_max_num_seqs_that_is_neither_auto_nor_a_count() -> None:
    from gateway.cli.main import cli

    for bad in ("0", "-3", "many"):
        result = CliRunner().invoke(cli, ["engine", "serve", "--model", "x", "--max-num-seqs", bad])
        assert result.exit_code == 2 and "neither `auto` nor a positive whole number" in result.output


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("fp32", "auto"), ("fp32", "bf16"), ("bf16", "auto"),
                                                       ("auto", "auto")])
def test_the_gateway_and_the_engine_size_the_batch_alike(dtype: str, kv_cache_dtype: str, tmp_path: Path) -> None:
    """The same number from the gateway's reckoning and from a real ModelRunner's KV cache (`auto` in the engine)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import launch
    from engine.model_runner import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_BYTES, ModelRunner

    assert (supervisor.TYPICAL_REQUEST_TOKENS, supervisor.MAX_NUM_SEQS_CAP) == (
        launch.TYPICAL_REQUEST_TOKENS, launch.MAX_NUM_SEQS_CAP)
    assert (supervisor.ENGINE_KV_CACHE_BYTES, supervisor.KV_BLOCK_SIZE) == (DEFAULT_KV_CACHE_BYTES, DEFAULT_BLOCK_SIZE)
    torch.manual_seed(0)
    path = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(path)
    budget = 3 << 20  # 2 layers x 2 KV heads x 16: a few thousand tokens, so the cap does not decide
    runner = ModelRunner(path, dtype=dtype, kv_cache_bytes=budget, kv_cache_dtype=kv_cache_dtype)
    engine_says = launch.kv_max_num_seqs(runner.num_kv_blocks, runner.block_size)
    gateway_says = engine_max_num_seqs(spec(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=budget),
                                       tmp_path)
    assert gateway_says == engine_says > 1
