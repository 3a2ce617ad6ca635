"""Distillation on a tiny random teacher with SmolLM2's tokenizer: the loss falls and agreement rises, an
interrupted run resumes to exactly where an uninterrupted one ends, and the student loads in transformers
and in our engine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine.model_runner import ModelRunner
from tests.conftest import MODELS_DIR
from tests.engine.driver import generate_greedy
from training.distill import DistillConfig, DistillError, distill
from training.distill_data import heldout_windows
from training.distill_eval import compare, top1_and_nll
from training.student import layer_subset, logits, make_student

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, rope_theta=100000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked next-token distribution that depends on every layer: something to imitate
        model.model.norm.weight.mul_(20)
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4)
            layer.self_attn.o_proj.weight.mul_(4)
    path = tmp_path_factory.mktemp("tiny-teacher")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy2(MODELS_DIR / "smollm2-135m-instruct" / name, path / name)
    return path


def tiny_config(**overrides: object) -> DistillConfig:
    base = {"layers": 2, "frozen_prefix": 1, "budget_s": None, "steps": 40, "batch_size": 4, "seq_len": 32,
            "lr": 3e-3, "warmup_steps": 2, "seed": 7, "checkpoint_every_s": 3600.0}
    return DistillConfig(**(base | overrides))  # type: ignore[arg-type]


def test_layer_subset_keeps_the_prefix_and_ends_at_the_last_layer() -> None:
    assert layer_subset(30, 8) == [0, 1, 6, 10, 15, 20, 24, 29]
    assert layer_subset(4, 2, prefix=1) == [0, 3]
    assert layer_subset(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        layer_subset(4, 5)


def test_distillation_lowers_kl_and_raises_agreement(teacher_dir: Path, tmp_path: Path) -> None:
    result = distill(teacher_dir, tmp_path / "student", tiny_config(), progress=False)
    kls = [h["kl"] for h in result.history]
    assert len(kls) == 40
    assert sum(kls[-5:]) / 5 < 0.7 * sum(kls[:5]) / 5, kls
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    windows = heldout_windows(AutoTokenizer.from_pretrained(teacher_dir), seq_len=64, n_tokens=1024)
    teacher_top1, _ = top1_and_nll(teacher, windows)
    before = compare(make_student(teacher, result.keep), teacher_top1, windows)
    after = compare(AutoModelForCausalLM.from_pretrained(result.out_dir), teacher_top1, windows)
    assert after["top1_agreement"] > max(2 * before["top1_agreement"], before["top1_agreement"] + 0.03), (before, after)
    assert compare(teacher, teacher_top1, windows)["top1_agreement"] == 1.0


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(teacher_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(steps=6, checkpoint_every_s=0.0)
    whole = distill(teacher_dir, tmp_path / "whole", config, progress=False)

    def interrupt(step: int, _record: dict[str, float]) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(teacher_dir, tmp_path / "resumed", config, progress=False, on_step=interrupt)
    assert not (tmp_path / "resumed").exists()  # nothing half-written where the engine looks
    resumed = distill(teacher_dir, tmp_path / "resumed", config, progress=False)
    assert resumed.steps == 6 and [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    a = AutoModelForCausalLM.from_pretrained(whole.out_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.out_dir).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    with pytest.raises(DistillError, match="another run"):  # a checkpoint from other settings is not mixed in
        distill(teacher_dir, tmp_path / "resumed", tiny_config(steps=8, lr=1e-2, checkpoint_every_s=0.0),
                progress=False)


def test_a_checkpoint_write_that_fails_leaves_the_last_one_whole_and_nothing_else(
        teacher_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills during the second checkpoint: the first stays in place, no half-written file is left in the
    work directory (before, its fixed-name temporary file stayed), and the next run resumes from the first."""
    config, work = tiny_config(steps=4, checkpoint_every_s=0.0), tmp_path / "work"
    save, saves = torch.save, []

    def full_disk(obj: object, path: Path) -> None:
        saves.append(path)
        if len(saves) == 2:
            Path(path).write_bytes(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        save(obj, path)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        distill(teacher_dir, tmp_path / "student", config, work_dir=work, progress=False)
    monkeypatch.setattr(torch, "save", save)
    assert [p.name for p in work.iterdir()] == ["checkpoint.pt"]
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 1
    resumed = distill(teacher_dir, tmp_path / "student", config, work_dir=work, progress=False)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]


def test_the_student_loads_in_transformers_and_in_our_engine(teacher_dir: Path, tmp_path: Path) -> None:
    result = distill(teacher_dir, tmp_path / "student", tiny_config(steps=3), progress=False)
    out = result.out_dir
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES, "tiergate-student.json", "README.md"):
        assert (out / name).is_file(), name
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([prompt])).logits, logits(hf, torch.tensor([prompt])))
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    runner = ModelRunner(out, dtype="fp32", kv_cache_bytes=1 << 24)
    [ours], _ = generate_greedy(runner, [prompt], 6)
    assert ours == want


def test_the_cli_distils_and_refuses_bad_input_cleanly(teacher_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gateway.cli.main", "models", "distill", "--teacher", str(teacher_dir),
           "--layers", "2", "--frozen-prefix", "1", "--batch-size", "2", "--seq-len", "16"]
    bad = subprocess.run([*cmd, "--budget", "soon", "--out", str(tmp_path / "s")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "budget 'soon'" in bad.stderr and not (tmp_path / "s").exists()
    ok = subprocess.run([*cmd, "--budget", "2steps", "--out", str(tmp_path / "s")], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "top-1 agreement" in ok.stdout and f"ready: {tmp_path / 's'}" in ok.stdout
    assert "distilling" in ok.stderr  # the progress bar


@pytest.mark.parametrize(("device", "cuda_count", "said"), [
    ("tpu", 0, "neither cpu nor cuda"), ("cuda", 0, "sees no CUDA device"), ("cuda:1", 1, "cuda:0 to cuda:0")])
def test_a_device_torch_cannot_use_is_refused_by_name_before_any_work(
        teacher_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        device: str, cuda_count: int, said: str) -> None:
    """Callers other than the CLI (which checks --device at the option) get a DistillError, a ValueError naming the
    device, before the teacher loads: before, torch's RuntimeError or an error from deep in loading it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_count)
    loaded: list[object] = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    out, work = tmp_path / "student", tmp_path / "work"
    with pytest.raises(ValueError, match=f"device '{device}'.*{said}"):
        distill(teacher_dir, out, tiny_config(device=device), work_dir=work, progress=False)
    assert not loaded and not out.exists() and not work.exists()
