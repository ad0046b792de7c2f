"""SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before a kill) end training after the current
step with a whole checkpoint of it, exit code 143 and one line saying how to resume; resuming
ends with the weights of the uninterrupted run, bit for bit; a second SIGTERM during that save
ends the process at once and leaves the previous whole checkpoint, from which the run resumes
to the same weights.

Each run is the real ``mmembed sft`` in a child process that ``MMEMBED_TEST_PAUSE_AT`` holds at a
named point (the start of an optimizer step, a point of saving: mmembed/training/checkpoints.py)
until the test has sent its signal, so the step it lands in is known. The reference is an
uninterrupted run that saves every step; weights are compared exactly (one CPU thread)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, free_port, stsb_pairs
from forked_cli import run_cli
from safetensors.torch import load_file
from transformers import TrainerControl

from mmembed.training.charts import CHARTS_DIR
from mmembed.training.checkpoints import find_last_complete_checkpoint, is_complete, is_model_only
from mmembed.training.preemption import EXIT_CODE, PreemptionStop

STEPS = 6  # 16 pairs in batches of 2: 8 steps an epoch, so every stop is mid-epoch


@pytest.fixture(scope="module")
def setup(tmp_path_factory, minilm_path):
    d = tmp_path_factory.mktemp("preempt")
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in stsb_pairs(16)))
    common = ["sft", "--model", minilm_path, "--dataset", str(data), "--per_device_train_batch_size", "2",
              "--gradient_accumulation_steps", "1", "--max_steps", str(STEPS), "--max_length", "32",
              "--learning_rate", "5e-4", "--dataloader_num_workers", "0", "--disable_tqdm", "true",
              "--report_to", "none", "--logging_steps", "1"]
    ref = d / "reference"
    r = run_cli(common + ["--output_dir", str(ref), "--save_steps", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    return d, common, ref


def _assert_same_weights(ckpt, ref_ckpt):
    ours, ref = (load_file(os.path.join(c, "adapter_model.safetensors")) for c in (ckpt, ref_ckpt))
    assert ours.keys() == ref.keys()
    different = [k for k in ref if not torch.equal(ours[k], ref[k])]
    assert not different, f"{ckpt} differs from {ref_ckpt} in {different[:3]}"


def _folders(out):
    return sorted(n for n in os.listdir(out) if n != CHARTS_DIR)


class Paused:
    """``mmembed ARGV`` in a child process, held at the points ``pause_at`` names until released."""

    def __init__(self, d, argv, pause_at):
        self.flag = d / "paused"
        self.out, self.err = d / "stdout.txt", d / "stderr.txt"
        env = dict(os.environ, OMP_NUM_THREADS="1", MMEMBED_TEST_PAUSE_AT=pause_at, MMEMBED_TEST_PAUSE_FILE=str(self.flag))
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "mmembed.tools.cli", *argv], env=env, stdout=out,
                                         stderr=err, cwd=REPO)

    def wait_paused(self, timeout=300) -> str:
        """The point the child waits at (it created the flag file)."""
        return _wait_for(self.flag, self.proc, self.err, timeout).split()[0]

    def release(self):
        self.flag.unlink()

    def finish(self, timeout=300):
        code = self.proc.wait(timeout)
        return code, self.out.read_text(), self.err.read_text()


def _wait_for(flag, proc, err, timeout=300) -> str:
    """What the paused process wrote into ``flag`` (the point's name and its process id)."""
    deadline = time.monotonic() + timeout
    while not flag.exists():
        assert proc.poll() is None, f"exited {proc.returncode} before pausing: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the run never reached its pause"
        time.sleep(0.05)
    return flag.read_text()


def _stop_two_ranks(proc, err, tmp_path, send) -> tuple[int, str]:
    """Wait until both ranks pause at their step, ``send(rank0_pid)`` the signal, release them;
    the exit code and stderr of ``proc``."""
    try:
        ranks = [tmp_path / f"paused.rank{r}" for r in (0, 1)]
        point, pid = _wait_for(ranks[0], proc, err).split()
        assert point == "train:step"
        _wait_for(ranks[1], proc, err)
        send(int(pid))
        time.sleep(1.0)  # each signalled worker's handler runs in its main thread as it polls the pause file
        for f in ranks:
            f.unlink()
        code = proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, err.read_text()


def _one_line(stderr):
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("mmembed sft:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_mid_epoch_saves_the_step_and_resumes_to_the_uninterrupted_run(setup, tmp_path, sig):
    d, common, ref = setup
    out = tmp_path / "run"
    args = common + ["--output_dir", str(out), "--save_steps", "100"]  # no checkpoint before the last step
    run = Paused(tmp_path, args, "train:step:3")
    assert run.wait_paused() == "train:step"
    run.proc.send_signal(sig)  # arrives while step 3 begins: it is finished, saved, and training stops
    run.release()
    code, _, stderr = run.finish()
    assert code == EXIT_CODE, stderr[-3000:]
    line = _one_line(stderr)
    ckpt = out / "checkpoint-3"
    assert line == (f"mmembed sft: stopped by {sig.name} at step 3: saved the whole checkpoint {ckpt}; to go on, "
                    "run the same command with the same --output_dir and --resume_from_checkpoint true")
    assert _folders(out) == ["checkpoint-3"]
    assert is_complete(str(ckpt)) and not is_model_only(str(ckpt))
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 3
    _assert_same_weights(ckpt, ref / "checkpoint-3")  # the step it was signalled in, whole

    resumed = run_cli(args + ["--resume_from_checkpoint", "true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_weights(out / f"checkpoint-{STEPS}", ref / f"checkpoint-{STEPS}")


def test_second_sigterm_during_the_save_exits_at_once_leaving_the_last_whole_checkpoint(setup, tmp_path):
    d, common, ref = setup
    out = tmp_path / "run"
    args = common + ["--output_dir", str(out), "--save_steps", "2"]
    # the 2nd save reaching save:model is the one the first SIGTERM asks for (step 3)
    run = Paused(tmp_path, args, "train:step:3,save:model:2")
    assert run.wait_paused() == "train:step"
    run.proc.send_signal(signal.SIGTERM)
    run.release()
    assert run.wait_paused() == "save:model"  # checkpoint-3's weights are written, the rest not yet
    run.proc.send_signal(signal.SIGTERM)
    code, _, stderr = run.finish(timeout=30)  # at once, not after the save
    assert code == -signal.SIGTERM, stderr[-3000:]
    assert _folders(out) == [".partial-checkpoint-3", "checkpoint-2"]
    assert find_last_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
    _assert_same_weights(out / "checkpoint-2", ref / "checkpoint-2")

    resumed = run_cli(args + ["--resume_from_checkpoint", "true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_weights(out / f"checkpoint-{STEPS}", ref / f"checkpoint-{STEPS}")
    # the cut save's staging folder stays (never read; a save of step 3 or a rotation would clear it)
    assert _folders(out) == [".partial-checkpoint-3", "checkpoint-2", "checkpoint-4", f"checkpoint-{STEPS}"]


def test_save_strategy_no_saves_the_model_and_says_it_cannot_resume(setup, tmp_path):
    d, common, ref = setup
    out = tmp_path / "run"
    run = Paused(tmp_path, common + ["--output_dir", str(out), "--save_strategy", "no"], "train:step:3")
    run.wait_paused()
    run.proc.send_signal(signal.SIGTERM)
    run.release()
    code, _, stderr = run.finish()
    assert code == EXIT_CODE, stderr[-3000:]
    line = _one_line(stderr)
    final = out / "checkpoint-3"
    assert f"stopped by SIGTERM at step 3: saved the trained model alone as {final}" in line
    assert "cannot resume" in line and "--resume_only_model true" in line
    assert _folders(out) == ["checkpoint-3"]
    assert is_complete(str(final)) and is_model_only(str(final))
    _assert_same_weights(final, ref / "checkpoint-3")


def _control():
    return TrainerControl()


def test_handlers_only_for_the_loop_and_a_second_signal_is_the_default():
    """In-process: the handlers are installed for the loop and restored after; a signal only
    sets the flag and gives both signals their default action back; the step that sees the
    flag saves and stops (or, with --save_strategy no, only stops)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    stop = PreemptionStop()
    args = SimpleNamespace(device="cpu", save_strategy="steps")
    state = SimpleNamespace(global_step=4)
    with stop.handling():
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        control = stop.on_step_end(args, state, _control())
        assert not control.should_save and not control.should_training_stop and stop.stopped_at is None
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(100):  # Python runs the handler between bytecodes
            if stop.requested:
                break
            time.sleep(0.01)
        assert stop.requested == "SIGUSR1"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL == signal.getsignal(signal.SIGUSR1)
        control = stop.on_step_end(args, state, _control())
        assert control.should_save and control.should_training_stop and stop.stopped_at == 4
        epoch_end = _control()
        epoch_end.should_save = True  # --save_strategy epoch: the step is saved already
        assert not stop.on_epoch_end(args, state, epoch_end).should_save
        control = stop.on_step_end(SimpleNamespace(device="cpu", save_strategy="no"), state, _control())
        assert control.should_training_stop and not control.should_save
    assert {s: signal.getsignal(s) for s in before} == before


def test_two_processes_stop_at_the_same_step_when_only_rank_0_is_signalled(setup, tmp_path):
    """Under torchrun only rank 0 gets SIGTERM (as from launchers that signal one process): the
    processes agree at the end of the step, both stop there, and one whole checkpoint of it is
    saved (neither waits in a collective the other never reaches)."""
    d, common, ref = setup
    out = tmp_path / "run"
    flag = tmp_path / "paused"
    argv = common + ["--output_dir", str(out), "--save_steps", "100", "--per_device_train_batch_size", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MMEMBED_TEST_PAUSE_AT="train:step:3", MMEMBED_TEST_PAUSE_FILE=str(flag))
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "-m", "mmembed.tools.cli", *argv], env=env, stdout=subprocess.DEVNULL, stderr=f,
                                cwd=REPO)
    code, stderr = _stop_two_ranks(proc, err, tmp_path, lambda pid: os.kill(pid, signal.SIGTERM))  # rank 0 alone
    ours = stderr.split("torch/distributed/elastic/multiprocessing/api.py")[0]  # before torchrun's failure report
    assert code != 0 and "Traceback" not in ours, stderr[-3000:]
    lines = [line for line in ours.splitlines() if line.startswith("mmembed sft:")]
    assert lines == [f"mmembed sft: stopped by SIGTERM at step 3: saved the whole checkpoint {out / 'checkpoint-3'}; "
                     "to go on, run the same command with the same --output_dir and --resume_from_checkpoint true"]
    # torchrun's report of each rank's exit code: rank 1 stopped by itself (143); rank 0 too, unless
    # torchrun, seeing rank 1 end first, sent it SIGTERM while it exited (after the save and the line)
    codes = dict(re.findall(r"rank\s+: (\d) \(local_rank: \d\)\s+exitcode\s+: (-?\d+)", stderr))
    assert codes["1"] == "143" and codes.get("0", "143") in ("143", "-15"), stderr[-3000:]
    assert _folders(out) == ["checkpoint-3"] and is_complete(str(out / "checkpoint-3"))
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


def test_nproc_per_node_passes_the_signal_on_to_every_worker(setup, tmp_path):
    """ms-swift's launch habit (NPROC_PER_NODE=2 mmembed sft ...): the signal goes to the
    mmembed process that started torchrun (as Kubernetes signals a container's first process);
    it passes it on, every worker saves the same step, and the command exits 143."""
    d, common, ref = setup
    out = tmp_path / "run"
    flag = tmp_path / "paused"
    argv = common + ["--output_dir", str(out), "--save_steps", "100", "--per_device_train_batch_size", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
               MMEMBED_TEST_PAUSE_AT="train:step:3", MMEMBED_TEST_PAUSE_FILE=str(flag))
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "mmembed.tools.cli", *argv], env=env,
                                stdout=subprocess.DEVNULL, stderr=f, cwd=REPO)
    # the launching process alone; torchrun passes it on to both workers
    code, stderr = _stop_two_ranks(proc, err, tmp_path, lambda pid: proc.send_signal(signal.SIGTERM))
    assert code == EXIT_CODE, stderr[-3000:]
    # torchrun logs that it passes the signal on before the workers stop, so its lines and
    # theirs interleave: the saving worker's line is the one line of mmembed's
    lines = [line for line in stderr.splitlines() if line.startswith("mmembed sft:")]
    assert lines == [f"mmembed sft: stopped by SIGTERM at step 3: saved the whole checkpoint {out / 'checkpoint-3'}; "
                     "to go on, run the same command with the same --output_dir and --resume_from_checkpoint true"]
    assert _folders(out) == ["checkpoint-3"] and is_complete(str(out / "checkpoint-3"))
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
