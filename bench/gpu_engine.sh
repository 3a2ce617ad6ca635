#!/usr/bin/env bash
# The engine benchmark on a CUDA machine: our engine (bf16 and the int8 tier) against HF generate and a
# static padded batch, ceilings from the linear layers alone, follow-up TTFT. Run from the repository root:
#   bash bench/gpu_engine.sh            (writes bench-gpu-engine.md under $OUT or the current directory)
# For a CUDA machine with this project's venv. A lent machine with no network and its own Python runs the same
# steps through bench/gpu_payload.sh and bench/gpu_session.sh (BENCHMARKS.md, session 25).
set -euo pipefail
out_dir="${OUT:-.}"
python="${PYTHON:-.venv/bin/python}"
"$python" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(0), torch.__version__)
PY
# a quick correctness check first: greedy equals transformers on the tiny Llama, on the GPU
TIERGATE_TEST_DEVICE=cuda "$python" -m pytest -q tests/engine/test_model_runner.py -k "alone or staggered" \
  | tee "$out_dir/bench-gpu-engine-tests.txt"
"$python" -m bench.engine --device cuda --dtype bf16 --concurrency 1,4,16,64 --prompt-len 512 --output-len 128 \
  --hf-requests 4 --threads 8 | tee "$out_dir/bench-gpu-engine.md"
