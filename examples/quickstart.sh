#!/usr/bin/env bash
# Set up .venv (once) and run the quickstart: a full fine-tune of all-MiniLM-L6-v2 on
# STS-B positive pairs, with STS-B test metrics before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python examples/quickstart.py "$@"
