"""A non-finite loss or gradient stops the run at the first bad step, whatever caused it (a huge
learning rate, a huge teacher embedding in the data), with one line naming
the step and the last whole checkpoint, exit code 1, and no checkpoint saved after it; on 2
processes both stop. (A label out of its loss's range never gets this far: it is refused when
the data is read, tests/data/test_bad_data.py; nor does a temperature so small that float32
logits saturate, which once gave an infinite gradient norm here: it is refused before the
model loads, tests/training/test_untrainable.py, and below.)"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, stsb_pairs
from forked_cli import run_cli

from mmembed.training.charts import CHARTS_DIR
from mmembed.training.checkpoints import find_last_complete_checkpoint, is_complete


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("nonfinite")
    pairs = stsb_pairs(16)
    # each query's own text as a hard negative: at a tiny temperature the logits are ~1e30 apart
    groups = [{"query": p["query"], "response": p["response"], "rejected_response": [pairs[(i + 3) % 16]["response"], p["query"]]}
              for i, p in enumerate(pairs[:8])]
    # distillation from the data's teacher embeddings (all-MiniLM's width), one of them huge:
    # finite in float32, its squared distance is not
    rng = np.random.default_rng(0)
    teacher = [{"query": p["query"], "response": p["response"],
                "teacher_embeddings": (v / np.linalg.norm(v, axis=1, keepdims=True)).round(4).tolist()}
               for p, v in zip(pairs[:8], rng.normal(size=(8, 2, 384)))]
    teacher[5]["teacher_embeddings"][0][0] = 1e30
    files = {}
    for name, rows in (("groups", groups), ("teacher", teacher)):
        files[name] = d / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d, files


def _args(model, dataset, out, *extra):
    return ["sft", "--model", model, "--dataset", str(dataset), "--output_dir", str(out),
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", "4",
            "--save_steps", "1", "--max_length", "32", "--dataloader_num_workers", "0", "--disable_tqdm", "true",
            "--report_to", "none", "--logging_steps", "1", *extra]


def _error_line(stderr):
    lines = [line for line in stderr.splitlines() if line.startswith("mmembed sft: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


# (what makes it non-finite, the data, extra flags, environment, the first bad step, what is reported)
CASES = [
    ("learning_rate", "groups", ("--learning_rate", "1e30"), {}, 2, "loss is nan"),
    ("data", "teacher", ("--loss_type", "distill_mse"), {}, None, "loss is inf"),  # the step of the bad row's batch
]


@pytest.mark.parametrize("cause,dataset,flags,env,step,what", CASES, ids=[c[0] for c in CASES])
def test_the_first_non_finite_step_stops_the_run(minilm_path, data, tmp_path, cause, dataset, flags, env, step, what):
    d, files = data
    out = tmp_path / "run"
    r = run_cli(_args(minilm_path, files[dataset], out, *flags), env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    line = _error_line(r.stderr)
    step = step or int(re.search(r"at step (\d+);", line).group(1))
    last = str(out / f"checkpoint-{step - 1}") if step > 1 else "none"
    assert f"{what} at step {step};" in line and f"The last whole checkpoint is {last}." in line
    saved = sorted(n for n in os.listdir(out) if n != CHARTS_DIR) if out.exists() else []
    assert saved == [f"checkpoint-{s}" for s in range(1, step)]  # every step before the bad one, none after
    assert all(is_complete(str(out / name)) for name in saved)


def test_a_tiny_temperature_is_refused_before_training(minilm_path, data, tmp_path):
    """What gave an infinite gradient norm at step 1 (a temperature of 1e-30 with each query
    as its own negative) is refused up front now: one line, exit 2, nothing written."""
    d, files = data
    out = tmp_path / "run"
    r = run_cli(_args(minilm_path, files["groups"], out), env={"INFONCE_TEMPERATURE": "1e-30"})
    assert r.returncode == 2, r.stderr[-3000:]
    line = _error_line(r.stderr)
    assert "INFONCE_TEMPERATURE='1e-30'" in line and "smallest usable value is 9.3133e-10" in line
    assert not any(n.startswith("checkpoint-") for n in (os.listdir(out) if out.exists() else []))


def test_two_processes_stop_together(minilm_path, data, tmp_path):
    """The bad teacher embedding sits in one process's share of the batch; both stop at the
    same step (neither waits for a peer that has left), and both name the same checkpoint."""
    d, files = data
    out = tmp_path / "run"
    argv = _args(minilm_path, files["teacher"], out, "--loss_type", "distill_mse", "--per_device_train_batch_size", "1")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "mmembed.tools.cli", *argv], env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # one error per process (their lines may interleave), both at the same step, naming the same checkpoint
    errors = re.findall(r"mmembed sft: error: loss is (inf|not finite on another process) at step (\d+); training stopped, "
                        r"nothing saved after it\. The last whole checkpoint is (\S+)\.", proc.stderr)
    assert sorted(e[0] for e in errors) == ["inf", "not finite on another process"], proc.stderr[-3000:]
    assert errors[0][1:] == errors[1][1:]
    step = int(errors[0][1])
    last = find_last_complete_checkpoint(str(out))
    assert (last or "none") == errors[0][2]
    assert sorted(n for n in os.listdir(out) if n != CHARTS_DIR) == [f"checkpoint-{s}" for s in range(1, step)]
