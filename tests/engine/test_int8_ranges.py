"""The int8 tier's calibration kept beside the weights (engine/int8_ranges.py): read back only for the same inputs,
the same bits, and a build that cannot keep it still builds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from assets import atomic_file
from engine import int8_dynamic
from engine.int8_ranges import KEEP, PREFIX, cached_ranges
from engine.model_runner import ModelRunner


def chunks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 250, (48,), generator=g) for _ in range(3)]


@pytest.fixture()
def model_dir(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


class Counting:
    def __init__(self, value: float = 1.0) -> None:
        self.calls, self.value = 0, value

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"layers.0.mlp.down_proj": torch.full((4,), self.value)}


def test_the_same_inputs_read_the_kept_ranges_and_other_inputs_compute(model_dir: Path) -> None:
    compute = Counting()
    first = cached_ranges(model_dir, chunks(1), compute)
    again = cached_ranges(model_dir, chunks(1), Counting(2.0))  # would give other figures if it ran
    assert compute.calls == 1 and torch.equal(again["layers.0.mlp.down_proj"], first["layers.0.mlp.down_proj"])
    other = Counting(3.0)
    assert float(cached_ranges(model_dir, chunks(2), other)["layers.0.mlp.down_proj"][0]) == 3.0  # other tokens
    assert other.calls == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        other_threads = Counting(4.0)
        cached_ranges(model_dir, chunks(1), other_threads)  # another thread count may round otherwise: computed
        assert other_threads.calls == 1
    finally:
        torch.set_num_threads(threads)


def test_new_weights_of_the_same_names_compute_again(model_dir: Path) -> None:
    cached_ranges(model_dir, chunks(1), Counting())
    weights = next(model_dir.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor's bytes
    weights.write_bytes(bytes(data))
    again = Counting(5.0)
    assert float(cached_ranges(model_dir, chunks(1), again)["layers.0.mlp.down_proj"][0]) == 5.0
    assert again.calls == 1


def test_a_broken_entry_or_a_read_only_directory_only_costs_the_calibration(model_dir: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cached_ranges(model_dir, chunks(1), Counting())
    [entry] = model_dir.glob(f"{PREFIX}*.pt")
    entry.write_bytes(b"not a torch file")
    broken = Counting(6.0)
    assert float(cached_ranges(model_dir, chunks(1), broken)["layers.0.mlp.down_proj"][0]) == 6.0
    assert broken.calls == 1 and torch.load(entry, weights_only=True)["layers.0.mlp.down_proj"][0] == 6.0
    def refused(**_kw: object) -> None:
        raise PermissionError(13, "Permission denied")  # a directory we may not write into (root may write anywhere)

    monkeypatch.setattr(atomic_file.tempfile, "mkstemp", refused)
    locked = Counting(7.0)
    assert float(cached_ranges(model_dir, chunks(3), locked)["layers.0.mlp.down_proj"][0]) == 7.0
    assert locked.calls == 1 and len(list(model_dir.glob(f"{PREFIX}*.pt"))) == 1  # only the entry kept before


def test_the_directory_keeps_the_most_recent_entries_only(model_dir: Path) -> None:
    for seed in range(KEEP + 3):
        cached_ranges(model_dir, chunks(100 + seed), Counting())
    assert len(list(model_dir.glob(f"{PREFIX}*.pt"))) == KEEP
    assert not list(model_dir.glob(f".{PREFIX}*"))  # no temporary file left


def test_a_second_int8_runner_reads_the_ranges_and_is_the_same_model(model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_dynamic, "calibration_chunks", lambda _model_dir: chunks(3))  # no tokenizer here
    calibrations = []
    real = int8_dynamic.activation_ranges
    monkeypatch.setattr(int8_dynamic, "activation_ranges", lambda *a: calibrations.append(1) or real(*a))
    first = ModelRunner(model_dir, dtype="fp32", quantize="int8", kv_cache_bytes=1 << 22)
    second = ModelRunner(model_dir, dtype="fp32", quantize="int8", kv_cache_bytes=1 << 22)
    assert len(calibrations) == 1
    one, two = first.model.state_dict(), second.model.state_dict()
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, two[name]), name
    ids = chunks(9)[0]
    assert torch.equal(int8_dynamic.prefill_logits(first.model, ids), int8_dynamic.prefill_logits(second.model, ids))
