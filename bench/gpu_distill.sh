#!/usr/bin/env bash
# What more compute buys the distilled student: the same 10-minute budget on a CUDA device (bf16 autocast),
# bigger batches, then bench/distill.py against the CPU student's numbers in BENCHMARKS.md. Run from the
# repository root:  bash bench/gpu_distill.sh   (writes bench-gpu-distill.md under $OUT or the current directory)
# For a CUDA machine with this project's venv. A lent machine with no network and its own Python runs the same
# steps through bench/gpu_payload.sh and bench/gpu_session.sh (BENCHMARKS.md, session 25).
set -euo pipefail
out_dir="${OUT:-.}"
python="${PYTHON:-.venv/bin/python}"
student="${STUDENT:-/tmp/tiergate-gpu-student}"
"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))'
"$python" -m gateway.cli.main models distill --teacher full --device cuda --budget "${BUDGET:-10m}" \
  --batch-size 32 --seq-len 256 --lr 1e-3 --out "$student" --restart | tee "$out_dir/bench-gpu-distill.md"
"$python" -m bench.distill --student "$student" --threads 8 | tee -a "$out_dir/bench-gpu-distill.md"
