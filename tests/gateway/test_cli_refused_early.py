"""Options refused before any work starts (a model loaded, a teacher downloaded, answers generated), as one usage
error naming the option: --device, distil's --keep, router train's --out."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gateway.cli.main import cli


def run(args: list[str]) -> Result:
    return CliRunner().invoke(cli, args, env={"TIERGATE_DATABASE_URL": "", "TIERGATE_REDIS_URL": ""})


def never(*args: object, **kwargs: object) -> None:
    raise AssertionError("work started before the option was checked")


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, wherever the tests run


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CPU", "cuda"])
@pytest.mark.parametrize("command", [["engine", "serve", "--model", "/nonexistent"],
                                     ["models", "distill", "--teacher", "/nonexistent"]])
def test_a_device_this_torch_cannot_use_is_refused_at_the_option(tmp_path: Path, no_cuda: None, command: list[str],
                                                                 device: str) -> None:
    r = run([*command, "--device", device, "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "'--device'" in r.output and repr(device) in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)


def test_a_cuda_index_past_the_devices_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    r = run(["engine", "serve", "--model", "/nonexistent", "--device", "cuda:1", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "'--device'" in r.output and "cuda:0 to cuda:0" in r.output, r.output


def test_cpu_is_taken(tmp_path: Path) -> None:
    r = run(["engine", "serve", "--model", "/nonexistent", "--device", "cpu", "--data-dir", str(tmp_path)])
    assert "'--device'" not in r.output and "/nonexistent" in r.output, r.output  # on to the model


def test_distil_refuses_keep_before_preparing_the_teacher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--keep 1,2,zz` fetched the 600 MB teacher before it was read."""
    import training.students

    monkeypatch.setattr(training.students, "prepare_model", never)
    r = run(["models", "distill", "--teacher", "full", "--keep", "1,2,zz", "--models-dir", str(tmp_path / "m"),
             "--data-dir", str(tmp_path)])
    assert r.exit_code == 1 and "--keep '1,2,zz'" in r.output, (r.output, r.exception)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("out", ["a-file/difficulty.json", "a-file/deeper/difficulty.json", "a-dir"])
def test_router_train_checks_out_before_generating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str) -> None:
    import training.router_training

    monkeypatch.setattr(training.router_training, "train", never)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    r = run(["router", "train", "--out", str(tmp_path / out), "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "'--out'" in r.output, (r.output, r.exception)


def test_router_train_takes_an_out_whose_directory_it_can_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import training.router_training

    calls: list[Path] = []
    monkeypatch.setattr(training.router_training, "train", lambda catalogue, models, out, **_: calls.append(out))
    r = run(["router", "train", "--out", str(tmp_path / "new" / "d.json"), "--data-dir", str(tmp_path)])
    assert r.exit_code == 0 and calls == [tmp_path / "new" / "d.json"], (r.output, r.exception)
    assert not (tmp_path / "new").exists()  # made by the training, not by the check
