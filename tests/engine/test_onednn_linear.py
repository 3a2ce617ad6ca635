"""The fp32 linear layers on oneDNN's prepacked weights: the same function as nn.Linear, used by the runner.
Greedy equality with transformers through them is checked by test_model_runner.py and test_sharegpt_equality.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import onednn_linear
from engine.model_runner import ModelRunner
from engine.onednn_linear import OneDnnLinear, pack_linears_

pytestmark = pytest.mark.skipif(not onednn_linear.available(torch.device("cpu"), torch.float32),
                                reason="torch was built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear_at_any_row_count(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    packed = OneDnnLinear.of(lin)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
        # any leading shape, as nn.Linear takes
        torch.testing.assert_close(packed(x.view(1, rows, 96)), lin(x).view(1, rows, 200), rtol=1e-5, atol=1e-5)
        # a non-contiguous input (a slice of a wider tensor)
        wide = torch.randn(rows, 192)
        torch.testing.assert_close(packed(wide[:, ::2]), lin(wide[:, ::2]), rtol=1e-5, atol=1e-5)


def test_pack_replaces_every_linear_and_keeps_the_tied_embedding(tiny_llama: Path) -> None:
    runner = ModelRunner(tiny_llama, dtype="fp32")
    model = runner.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, OneDnnLinear) for m in model.modules()) == 2 * 4 + 1  # 2 layers x 4, and the head
    # the head got its own packed copy; the embedding it was tied to still looks tokens up
    ids = torch.tensor([3, 7, 255])
    with torch.inference_mode():
        hidden = torch.randn(3, model.config.hidden_size)
        torch.testing.assert_close(model.lm_head(hidden), hidden @ model.embed_tokens.weight.t(), rtol=1e-5, atol=1e-5)
        assert model.embed_tokens(ids).shape == (3, model.config.hidden_size)


def test_switch_keeps_nn_linear(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ONEDNN", "0")
    runner = ModelRunner(tiny_llama, dtype="fp32")
    assert type(runner.model.lm_head) is nn.Linear
    assert type(runner.model.layers[0].mlp.down_proj) is nn.Linear


def test_not_used_for_bf16_where_onednn_cannot_run_it() -> None:
    # bf16 needs AVX-512 (or AVX-NE-CONVERT) in oneDNN; elsewhere the runner keeps nn.Linear
    assert onednn_linear.available(torch.device("cpu"), torch.bfloat16) == \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not onednn_linear.available(torch.device("cpu"), torch.float16)


def test_pack_counts_what_it_replaced() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    assert pack_linears_(model) == 2
    assert isinstance(model[0], OneDnnLinear) and isinstance(model[2][0], OneDnnLinear)
    with torch.inference_mode():
        assert model(torch.randn(5, 4)).shape == (5, 2)


@pytest.mark.skipif(not onednn_linear.available(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN runs no bf16 on this CPU")
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_bf16_weights_under_fp32_inputs_round_the_input_and_widen_the_result(rows: int) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=True)
    packed = OneDnnLinear.of(lin, torch.bfloat16)
    assert packed.packed.dtype == torch.bfloat16 and packed.bias.dtype == torch.bfloat16
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        exact = lin(x)
        y = packed(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 200)
        assert not torch.allclose(y, exact, rtol=1e-6, atol=1e-6)  # bf16 rounding, not fp32 sums
        # what a bf16 nn.Linear gives on the bf16-rounded input, widened
        expected = lin.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
        torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)
        assert torch.equal(packed(x.view(1, rows, 96)), y.view(1, rows, 200))
    # the same dtype as the weight's is no conversion at all
    assert OneDnnLinear.of(nn.Linear(4, 4), torch.float32).weight_dtype is None


def _cpu_flags() -> set[str]:
    try:
        return {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                for f in line.split(":", 1)[1].split()}
    except OSError:
        return set()


# Measured where oneDNN runs AVX-512 (an AMD Zen 4 without AMX, session 16; an Intel Xeon with AMX, session 17, with
# oneDNN capped below AMX, TIERGATE_ONEDNN_AMX=0): there every row count from 2 up gives the same bits, fp32 and bf16.
# On AVX2-only CPUs oneDNN has kernels of its own whose choice by row count was not measured: there only a row alone
# against the same row in pairs (what the single-row rule is for) is asserted. `python -m bench.onednn_rows` measures
# the rest on any CPU. The cap is read once, at oneDNN's first use, so the counts are asserted here only without AMX,
# and in a fresh process below with the cap.
AVX512_BF16 = "avx512_bf16" in _cpu_flags()
MEASURED_ISA = "avx512f" in _cpu_flags() and "amx_tile" not in _cpu_flags()
DTYPES = [None] + ([torch.bfloat16] if onednn_linear.available(torch.device("cpu"), torch.bfloat16) else [])


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 1536), (960, 576), (3072, 576)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(weight_dtype: torch.dtype | None, out_features: int,
                                                              in_features: int) -> None:
    """SmolLM2's shapes: a row alone (a sequence decoding by itself), among a few (a batch of decodes) and among
    hundreds (a prompt) gives the same bits. oneDNN's single-row kernel rounded the down projection's sums (1,536
    inputs) differently on an AMD Zen 4, so a greedy answer changed with what it was batched with."""
    torch.manual_seed(in_features)
    packed = OneDnnLinear(torch.randn(out_features, in_features) * 0.05, None, weight_dtype)
    x = torch.randn(320, in_features)
    with torch.inference_mode():
        def in_groups(rows: int) -> torch.Tensor:
            return torch.cat([packed(x[i:i + rows]) for i in range(0, len(x), rows)])

        assert torch.equal(in_groups(1), in_groups(2))
        if MEASURED_ISA:
            whole = packed(x)
            for rows in (1, 2, 5, 16, 64):
                assert torch.equal(in_groups(rows), whole), rows


ROWS_IN_A_FRESH_PROCESS = """
import json, sys, torch
from engine import onednn_linear
from engine.onednn_linear import OneDnnLinear
dtypes = [None] + ([torch.bfloat16] if onednn_linear.available(torch.device("cpu"), torch.bfloat16) else [])
differ = []
for dtype in dtypes:
    for out_features, in_features in [(576, 1536), (960, 576), (3072, 576)]:
        torch.manual_seed(in_features)
        packed = OneDnnLinear(torch.randn(out_features, in_features) * 0.05, None, dtype)
        x = torch.randn(320, in_features)
        with torch.inference_mode():
            whole = packed(x)
            for rows in (1, 2, 5, 16, 32, 33, 64, 100):
                if not torch.equal(torch.cat([packed(x[i:i + rows]) for i in range(0, len(x), rows)]), whole):
                    differ.append([str(dtype), out_features, in_features, rows])
print(json.dumps(differ))
"""


@pytest.mark.skipif(not AVX512_BF16, reason="oneDNN's row-count kernels were measured on AVX-512 BF16 CPUs only")
def test_rows_are_independent_in_a_fresh_engine_process_kept_off_amx() -> None:
    """An engine process with TIERGATE_ONEDNN_AMX=0 (oneDNN capped below AMX before its first use): any row, alone,
    in a batch of decodes or in a prompt of hundreds, gives the same bits. With AMX, 33 to a few hundred bf16 rows ran
    on AMX tiles and rounded some rows otherwise than fewer or more (session 17, an Intel Xeon)."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"} | {"TIERGATE_ONEDNN_AMX": "0"}
    done = subprocess.run([sys.executable, "-c", ROWS_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], env=env, timeout=300, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


CAP = onednn_linear.ISA_CAP


@pytest.mark.parametrize(("amx", "preset", "expected"),
                         [(None, None, None), ("1", None, None), ("0", None, CAP), ("0", "AVX2", "AVX2")])
def test_the_isa_cap_is_set_only_when_amx_is_turned_off(monkeypatch: pytest.MonkeyPatch, amx: str | None,
                                                        preset: str | None, expected: str | None) -> None:
    for name, value in (("TIERGATE_ONEDNN_AMX", amx), ("ONEDNN_MAX_CPU_ISA", preset)):
        monkeypatch.setenv(name, "")  # recorded first, so that what the function sets is undone after the test too
        if value is None:  # (a cap left behind would reach every engine the later tests start)
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    onednn_linear.cap_isa_below_amx()
    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == expected
