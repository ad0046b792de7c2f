"""benchmarks/bench_gpu.py's ms-swift side: the rows it gives ms-swift, and (where ms-swift is
installed, MMEMBED_SWIFT_PYTHON) a dry run in which mmembed and ms-swift see the same first batch
and report the same first loss."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_query_rows_become_messages_rows_with_their_pictures(tmp_path):
    from benchmarks.gpu.models import to_messages_form

    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps({"query": "a red square", "response": "<image>", "rejected_response": ["<image>"],
                               "images": ["pos.png", "neg.png"]}) + "\n"
                   + json.dumps({"query": "a", "response": "b"}) + "\n")
    rows = [json.loads(x) for x in open(to_messages_form(str(src), str(tmp_path / "m.jsonl")))]
    assert rows[0] == {"messages": [{"role": "user", "content": "a red square"}],
                       "positive_messages": [[{"role": "user", "content": "<image>"}]], "positive_images": [["pos.png"]],
                       "negative_messages": [[{"role": "user", "content": "<image>"}]], "negative_images": [["neg.png"]]}
    assert rows[1] == {"messages": [{"role": "user", "content": "a"}],
                       "positive_messages": [[{"role": "user", "content": "b"}]]}


def test_dry_run_first_losses_agree_with_ms_swift(tmp_path):
    python = os.environ.get("MMEMBED_SWIFT_PYTHON")
    if not python:
        pytest.skip("ms-swift's side needs a python with ms-swift 4.6: set MMEMBED_SWIFT_PYTHON (e.g. "
                    "../swift-venv/bin/python, the venv tests/fixtures/swift/make_fixtures.py's docstring makes)")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_gpu.py"), "--dry_run", "--parts", "text",
                           "--text_models", "qwen3", "--steps", "2", "--work_dir", str(tmp_path)],
                          capture_output=True, text=True, env=dict(os.environ, MMEMBED_SWIFT_PYTHON=python), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if "ms-swift" in x and "first batch" not in x and "same batch" in x]
    assert line and "agree" in line[0], proc.stdout[-3000:]
