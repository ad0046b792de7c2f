#!/usr/bin/env bash
# The test command (README, and .ci/run): set up .venv if needed, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest tests "$@"
