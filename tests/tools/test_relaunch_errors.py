"""Under ms-swift's launch habit (``NPROC_PER_NODE=2 mmembed sft ...``) an error is mmembed's
one line, as in one process: torchrun's own report (its log lines and the ChildFailedError
block) goes to a log file the last line names, and the exit status is the run's."""

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_error_under_nproc_per_node_is_one_line_and_torchruns_report_a_file(tiny_model, tmp_path):
    env = dict(os.environ, NPROC_PER_NODE="2", MASTER_PORT=str(_port()), OMP_NUM_THREADS="1")
    env.pop("MMEMBED_DEBUG", None)
    missing = tmp_path / "missing.jsonl"
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:  # a file, as a job's log is: the processes' lines and the last one all kept
        code = subprocess.run([sys.executable, "-m", "mmembed.tools.cli", "sft", "--model", tiny_model("qwen3"),
                               "--dataset", str(missing), "--output_dir", str(tmp_path / "out")],
                              stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=REPO, timeout=300).returncode
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    assert code == 1, lines
    one = f"mmembed sft: error: --dataset: dataset file or folder not found: '{missing}' (from spec '{missing}')"
    assert lines[:-1] == [one, one]  # each process's one line, nothing of torchrun's
    assert lines[-1].startswith("mmembed: torchrun's report of the stopped processes: ")
    report = lines[-1].split(": ", 2)[2]
    assert "ChildFailedError" in open(report, encoding="utf-8").read()
    os.remove(report)
