#!/usr/bin/env bash
# The test command (README, and .ci/run): set up .venv if needed, lint, build the documentation
# site, then run the whole suite on MMEMBED_TEST_WORKERS pytest-xdist workers (default 2, one
# per core here; 1 runs it in one process), each file on one worker, the longest files first
# (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# MMEMBED_TEST_VENV: a venv set up already (.ci/newest's), used as it is; default: .venv, set up here
if [ -n "${MMEMBED_TEST_VENV:-}" ]; then
  . "$MMEMBED_TEST_VENV/bin/activate"
else
  bash examples/install.sh
  . .venv/bin/activate
fi
workers=${MMEMBED_TEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
# one thread per worker: two workers of two threads each would contend for two cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$workers" -gt 1 ] && echo 1 || echo 2)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# DeepSpeed's CPU Adam op (the offload tests) is compiled on first use (~2 min of two cores) and kept in
# this venv's own folder: in the shared ~/.cache/torch_extensions a second checkout's build of the same op
# (other include paths) replaces it, and each checkout would compile it again on every run
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$VIRTUAL_ENV/torch_extensions}
# the linter first (its rules: [tool.ruff] in pyproject.toml): a name defined twice, an unused
# import or a bug pattern fails the run before any test starts
echo "lint: ruff $(ruff --version | cut -d' ' -f2)"
ruff check --no-cache mmembed tests benchmarks examples docs
# then the documentation site (mkdocs.yml), built strict into a temporary folder: a broken link or
# anchor, a page left out of the nav, a stale API reference or a generated table whose source
# moved (docs/hooks/generated.py) fails the run before any test starts; a few seconds, offline
echo "docs: mkdocs $(python -c 'import mkdocs; print(mkdocs.__version__)') build --strict"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# (not --quiet: it hides the warnings that --strict counts, and a broken link would pass)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
# --durations: every run shows where the time goes (the suite must stay under 20 minutes)
python -m pytest tests "${parallel[@]}" --durations=30 "$@"
