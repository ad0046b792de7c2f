#!/usr/bin/env bash
# The test command (README, and .ci/run): set up .venv if needed, then run the whole suite on
# MMEMBED_TEST_WORKERS pytest-xdist workers (default 2, one per core here; 1 runs it in one
# process), each file on one worker, the longest files first (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh
. .venv/bin/activate
workers=${MMEMBED_TEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
# one thread per worker: two workers of two threads each would contend for two cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$workers" -gt 1 ] && echo 1 || echo 2)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest tests "${parallel[@]}" "$@"
