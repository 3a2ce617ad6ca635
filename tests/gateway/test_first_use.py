"""`tiergate serve` on first use builds a missing student in the background, once, while it serves."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from assets.builds import build_lock
from gateway.cli.first_use import build_commands
from gateway.config_files import load_yaml
from gateway.settings import Settings
from tests.conftest import MODELS_DIR, free_port
from tiers.catalogue import TierCatalogue

ROOT = Path(__file__).resolve().parents[2]
TIERS = """
tiers:
  small:
    backend: local
    model: students/tiny-small
    distill: {{teacher: full, layers: 1, budget: 3steps}}
    max_num_seqs: 2
    kv_cache_bytes: 8388608
    threads: 1
    price_per_1k_input: "0.0001"
    price_per_1k_output: "0.0002"
    hardware_cost_per_hour: "0.01"
    context_limit: 512
  full:
    backend: local
    model: {teacher}
    max_num_seqs: 2
    kv_cache_bytes: 8388608
    threads: 1
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "0.1"
    context_limit: 512
"""


@pytest.fixture
def setup(tmp_path: Path, prepared_models: Path) -> Settings:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    teacher = tmp_path / "teacher"
    LlamaForCausalLM(cfg).save_pretrained(teacher)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(MODELS_DIR / "smollm2-135m-instruct" / name, teacher / name)
    (tmp_path / "tiers.yaml").write_text(TIERS.format(teacher=teacher))
    plans = (ROOT / "quotas" / "plans.yaml").read_text().replace("[small, mid, full]", "[small, full]")
    plans = plans.replace("[small, mid]", "[small, full]").replace("default_tier: mid", "default_tier: full")
    (tmp_path / "plans.yaml").write_text(plans)
    return Settings(data_dir=tmp_path / "data", models_dir=tmp_path / "models", tiers_file=tmp_path / "tiers.yaml",
                    plans_file=tmp_path / "plans.yaml", port=free_port(), build_router_model=False)


def test_build_commands_skip_what_is_built_or_being_built(setup: Settings) -> None:
    catalogue = load_yaml(setup.tiers_file, TierCatalogue)
    [cmd] = build_commands(setup, catalogue)
    assert cmd[3:6] == ["models", "distill", "--teacher"] and "full" in cmd
    with build_lock(setup.resolved_models_dir / "students" / "tiny-small"):  # another process is building it
        assert build_commands(setup, catalogue) == []


def test_serve_distils_the_missing_student_once_and_then_serves_it(setup: Settings) -> None:
    env = os.environ | {"TIERGATE_DATA_DIR": str(setup.data_dir), "TIERGATE_MODELS_DIR": str(setup.models_dir),
                        "TIERGATE_TIERS_FILE": str(setup.tiers_file), "TIERGATE_PLANS_FILE": str(setup.plans_file),
                        "TIERGATE_PORT": str(setup.port), "TIERGATE_BUILD_ROUTER_MODEL": "0"}
    log = open(setup.data_dir.parent / "serve.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{setup.port}"
    seen: set[str] = set()
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None and time.time() < deadline, Path(log.name).read_text()[-3000:]
            try:
                admin = json.loads((setup.data_dir / "bootstrap-keys.json").read_text())["admin_key"]
                small = httpx.get(f"{url}/health", headers={"authorization": f"Bearer {admin}"},
                                  timeout=2).json()["tiers"]["small"]
            except (httpx.HTTPError, KeyError, ValueError, OSError):
                time.sleep(0.5)
                continue
            seen.add(small["replicas"][0]["status"])
            if small["ready"]:
                break
            time.sleep(0.5)
        student = setup.resolved_models_dir / "students" / "tiny-small"
        assert (student / "README.md").is_file() and (student / "model.safetensors").is_file()
        assert seen & {"unavailable", "preparing"}, seen  # it was reported, not silently missing
        output = Path(log.name).read_text()
        assert output.count("distilling") >= 1 and "ready: " in output  # the child's progress bar and result
        mtime = (student / "model.safetensors").stat().st_mtime
        while (demo := re.search(r"demo key\s+: (tg-\S+)", output)) is None and time.time() < deadline:
            time.sleep(0.5)  # the banner follows readiness by up to a second (serve.py polls once a second)
            output = Path(log.name).read_text()
        assert demo, output[-2000:]
        resp = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {demo.group(1)}"},
                          json={"model": "small", "max_tokens": 4, "temperature": 0,
                                "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert resp.status_code == 200 and resp.headers["x-tiergate-tier"] == "small", resp.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    # a second start finds the student built: nothing is distilled again
    catalogue = load_yaml(setup.tiers_file, TierCatalogue)
    assert build_commands(setup, catalogue) == []
    assert (student / "model.safetensors").stat().st_mtime == mtime
