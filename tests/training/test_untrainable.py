"""Nothing trains on nothing.

- Rows the loss cannot learn from under the settings in force (no negatives with
  ``INFONCE_USE_BATCH=false``: the only candidate is the positive; none to sample from with
  ``INFONCE_HARD_NEGATIVES``) are counted and named before the model loads: no row left that
  can train is one line (exit 2); some are a warning with the count and the first rows'
  ``file:line`` (an error when the loss would fail on them), skipped and listed under
  ``--strict false``, which then trains on the rest.
- A temperature so small that float32 logits saturate is refused with the smallest usable
  value, which is checked here numerically on both sides.
- A run whose loss and gradient are exactly 0 for ``--zero_loss_patience`` steps in a row (a
  loss of the user's that returns ``0 * emb.sum()``) stops with one line naming the step and
  the last whole checkpoint, which stays whole.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, stsb_pairs, write_jsonl
from forked_cli import run_cli, run_ranks

from mmembed.losses import InfoNCEConfig, build_loss
from mmembed.losses.base import MIN_TEMPERATURE, MIN_TEMPERATURE_TEXT
from mmembed.tools.cli import main
from mmembed.training.checkpoints import find_last_complete_checkpoint, is_complete
from mmembed.training.guards import ZeroLossError, ZeroLossStop


class ModelLoaded(BaseException):
    """Raised by the patched loader: the check came after the model started loading."""


NEGATIVES = [3, 4]  # the (0-based) rows of the mixed file that carry a negative


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("untrainable")
    pairs = stsb_pairs(16)
    mixed = [dict(p) for p in pairs[:8]]
    for i in NEGATIVES:
        mixed[i]["rejected_response"] = [pairs[8 + i]["response"]]
    return {"pairs": write_jsonl(d / "pairs.jsonl", pairs[:8]), "mixed": write_jsonl(d / "mixed.jsonl", mixed)}


@pytest.fixture
def sft_until_model(minilm_path, tmp_path, monkeypatch, capsys, caplog):
    """``run(dataset, env, *flags) -> (exit status or "model", stderr and log lines)``:
    ``mmembed sft`` in this process with the model loader replaced by one that raises
    ModelLoaded ("model": every check before the model passed)."""
    import mmembed.training.model_assembly

    def loaded(*args, **kwargs):
        raise ModelLoaded

    monkeypatch.setattr(mmembed.training.model_assembly, "load_backbone", loaded)
    saved = dict(os.environ)  # parsing may set variables

    def run(dataset, env, *flags):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        try:
            status = main(["sft", "--model", minilm_path, "--dataset", dataset, "--output_dir", str(tmp_path / "out"),
                           "--max_steps", "1", "--report_to", "none", "--dataset_shuffle", "false", *flags])
        except ModelLoaded:
            status = "model"
        err = capsys.readouterr().err + "\n" + "\n".join(r.getMessage() for r in caplog.records)
        caplog.clear()
        return status, [line for line in err.splitlines() if line.strip() and not line.rstrip().endswith(("s]", "it/s]"))]

    yield run
    os.environ.clear()
    os.environ.update(saved)


def _error(lines):
    errors = [line for line in lines if line.startswith("mmembed sft: error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    return errors[0]


def test_pairs_without_negatives_under_use_batch_false_are_refused_before_the_model_loads(sft_until_model, files):
    status, lines = sft_until_model(files["pairs"], {"INFONCE_USE_BATCH": "false"})
    assert status == 2, lines
    line = _error(lines)
    assert "no training row can train: every one of the 8 has no negatives" in line
    assert "INFONCE_USE_BATCH=false" in line and "its loss is 0 and its gradient 0" in line
    # the first five rows named, in order
    named = re.findall(r"pairs\.jsonl:(\d+)", line)
    assert named == ["1", "2", "3", "4", "5"], line


def test_a_mix_warns_with_the_count_and_names_the_rows(sft_until_model, files):
    status, lines = sft_until_model(files["mixed"], {"INFONCE_USE_BATCH": "false"})
    assert status == "model", lines  # kept: a warning, then training would start
    warning = [line for line in lines if "cannot train" in line]
    assert len(warning) == 1, lines
    assert "6 of 8 rows cannot train" in warning[0] and "--strict false skips them" in warning[0]
    short = [i + 1 for i in range(8) if i not in NEGATIVES][:5]
    assert re.findall(r"mixed\.jsonl:(\d+)", warning[0]) == [str(n) for n in short]


def test_strict_false_lists_and_skips_them(sft_until_model, files):
    status, lines = sft_until_model(files["mixed"], {"INFONCE_USE_BATCH": "false"}, "--strict", "false")
    assert status == "model", lines
    start = next(i for i, line in enumerate(lines) if "skipped 6 of 8 row(s) that cannot train (--strict false)" in line)
    listed = [int(n) for n in re.findall(r"mixed\.jsonl:(\d+): no negatives", "\n".join(lines[start + 1 : start + 7]))]
    assert listed == [i + 1 for i in range(8) if i not in NEGATIVES]  # every one, not only the first few


def test_hard_negatives_with_rows_without_negatives_is_one_line(sft_until_model, files):
    """Before: a traceback after the model loaded. The loss would fail on such a row, so a mix
    is an error too (not a warning), unless --strict false skips them."""
    status, lines = sft_until_model(files["mixed"], {"INFONCE_HARD_NEGATIVES": "2"})
    assert status == 2, lines
    line = _error(lines)
    assert "6 of 8 training rows have no negatives" in line and "INFONCE_HARD_NEGATIVES" in line
    assert re.findall(r"mixed\.jsonl:(\d+)", line) == ["1", "2", "3", "6", "7"] and "mixed.jsonl:7, ...)" in line
    assert "--strict false" in line
    status, lines = sft_until_model(files["mixed"], {"INFONCE_HARD_NEGATIVES": "2"}, "--strict", "false")
    assert status == "model" and any("skipped 6 of 8 row(s) that cannot train" in line for line in lines), lines


def test_hard_negatives_checks_the_eval_rows_too(sft_until_model, files):
    """The eval loss would fail on a val row without negatives: it is refused by name too."""
    status, lines = sft_until_model(files["mixed"], {"INFONCE_HARD_NEGATIVES": "2"}, "--strict", "false",
                                    "--val_dataset", files["pairs"])
    assert status == 2, lines
    assert "no val row can train: every one of the 8 has no negatives" in _error(lines)


def test_a_row_that_can_train_is_not_counted(sft_until_model, files):
    """With in-batch candidates (the default) a row without negatives still trains: no word."""
    status, lines = sft_until_model(files["pairs"], {})
    assert status == "model" and not any("cannot train" in line for line in lines), lines


def test_strict_false_trains_on_the_rest(minilm_path, files, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, INFONCE_USE_BATCH="false", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = run_cli(["sft", "--model", minilm_path, "--dataset", files["mixed"], "--strict", "false", "--max_steps", "2",
                 "--per_device_train_batch_size", "2", "--output_dir", str(out), "--report_to", "none",
                 "--max_length", "32"], env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 6 of 8 row(s) that cannot train" in r.stderr
    saved = json.loads((out / "checkpoint-2" / "mmembed.json").read_text())
    assert saved["data"]["train_rows"] == len(NEGATIVES)
    metrics = json.loads(r.stdout[r.stdout.rindex("{\n"):])
    # every group trained on has a negative: its loss is a real cross-entropy, not 0
    assert metrics["train_loss"] > 0


def test_streaming_meets_them_as_they_are_read(minilm_path, files, tmp_path):
    """--streaming reads rows as it trains: under INFONCE_HARD_NEGATIVES a row without
    negatives is a data error naming it when it is read (one line, exit 1, no traceback)."""
    out = tmp_path / "run"
    r = run_cli(["sft", "--model", minilm_path, "--dataset", files["mixed"], "--streaming", "true",
                 "--dataset_shuffle", "false", "--max_steps", "2", "--per_device_train_batch_size", "2",
                 "--max_length", "32", "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "true",
                 "--dataloader_num_workers", "0"], env={"INFONCE_HARD_NEGATIVES": "2"}, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("mmembed sft: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.search(r"mixed\.jsonl:1: no negatives: hard_negatives 2 \(INFONCE_HARD_NEGATIVES\)", lines[0]), lines


# ----------------------------------------------------------------------------- the temperature


def _group(gap_ulps):
    """A group whose negative scores ``gap_ulps`` steps of 2**-24 below its positive (1.0):
    1 step is the smallest gap float32 holds near 1. Returns anchor, positive, negative."""
    anchor = torch.tensor([1.0, 0.0])
    negative = torch.tensor([1.0 - gap_ulps * 2.0**-24, 0.0], requires_grad=True)
    assert float(anchor @ anchor - anchor @ negative.detach()) == gap_ulps * 2.0**-24  # representable, exactly
    return anchor, anchor.clone(), negative


def _infonce(temperature, gap_ulps=1):
    """InfoNCE over the own group (``use_batch=False``): loss and the negative's gradient."""
    anchor, positive, negative = _group(gap_ulps)
    loss_fn = build_loss("infonce", temperature=temperature, use_batch=False)
    loss = loss_fn({"last_hidden_state": torch.stack([anchor, positive, negative])}, torch.tensor([1.0, 0.0]))
    loss.backward()
    return float(loss.detach()), negative.grad


def _written_out(temperature, gap_ulps=1):
    """The same loss written out, for temperatures the loss refuses: cross-entropy over
    ``[s(a, p), s(a, n)] / T`` with target 0. Returns loss, gradient and the two logits."""
    anchor, positive, negative = _group(gap_ulps)
    logits = torch.stack([anchor @ positive, anchor @ negative]) / temperature
    loss = torch.nn.functional.cross_entropy(logits[None], torch.tensor([0]))
    loss.backward()
    return float(loss.detach()), negative.grad, logits.detach()


def test_the_smallest_usable_temperature_is_derived_and_holds():
    assert MIN_TEMPERATURE == 2.0**-30 and float(MIN_TEMPERATURE_TEXT) >= MIN_TEMPERATURE
    # at the stated minimum (and at its text) the smallest gap still gives a gradient, though the
    # loss itself rounds to 0: exp(-64) is a float32 number
    for temperature in (MIN_TEMPERATURE, float(MIN_TEMPERATURE_TEXT)):
        loss, grad = _infonce(temperature)
        assert bool((grad != 0).any()) and bool(torch.isfinite(grad).all()), temperature
        assert torch.equal(grad, _written_out(temperature)[1])  # the written-out formula is the loss's
    # just below it every gap float32 keeps between the logits saturates: the one-step gap is lost
    # (the logits are equal), and a larger one gives loss exactly 0 and gradient exactly 0
    below = MIN_TEMPERATURE * (1 - 2.0**-23)
    assert float(torch.tensor(below)) < MIN_TEMPERATURE  # a different float32 number
    _, _, logits = _written_out(below, 1)
    assert logits[0] == logits[1]
    for gap in (2, 3, 8, 2**10):
        loss, grad, logits = _written_out(below, gap)
        assert logits[0] > logits[1] and loss == 0.0 and not bool(grad.any()), gap
    # ... and is refused, naming the variable and the smallest usable value
    with pytest.raises(ValueError, match=rf"INFONCE_TEMPERATURE='{below!r}'.*smallest usable value is 9\.3133e-10"):
        InfoNCEConfig.from_env({"INFONCE_TEMPERATURE": repr(below)})
    with pytest.raises(ValueError, match=r"INFONCE_TEMPERATURE='1e-30'.*smallest usable value is 9\.3133e-10"):
        InfoNCEConfig.from_env({"INFONCE_TEMPERATURE": "1e-30"})
    assert InfoNCEConfig.from_env({"INFONCE_TEMPERATURE": MIN_TEMPERATURE_TEXT}).temperature >= MIN_TEMPERATURE
    for name in ("gist", "distill_kl"):  # the other losses that divide similarities by a temperature
        with pytest.raises(ValueError, match="smallest usable value is 9.3133e-10"):
            build_loss(name, temperature=1e-30)


# ----------------------------------------------------------------------------- the zero-loss stop


ZERO_LOSS = '''
from mmembed.losses import EmbeddingLoss


class ZeroLoss(EmbeddingLoss):
    """A loss that learns nothing: exactly 0, with a gradient of exactly 0."""

    def forward(self, outputs, labels):
        return 0 * outputs["last_hidden_state"].sum()
'''


def _zero_run(minilm_path, tmp_path, *flags):
    (tmp_path / "zero_loss.py").write_text(ZERO_LOSS)
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(8))
    # the command line in a child forked from the test server (tests/forked_cli.py), the loss module on its path
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    r = run_cli(["sft", "--model", minilm_path, "--dataset", data,
                 "--loss_type", "zero_loss:ZeroLoss", "--per_device_train_batch_size", "2",
                 "--save_steps", "4", "--max_length", "32", "--output_dir", str(out), "--report_to", "none",
                 "--logging_steps", "1", "--disable_tqdm", "true", *flags], env=env, timeout=600)
    return r, out


def test_a_run_that_learns_nothing_stops_after_n_steps(minilm_path, tmp_path):
    r, out = _zero_run(minilm_path, tmp_path, "--max_steps", "30")  # the default patience, 10
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("mmembed sft: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "loss and gradient are exactly 0 for 10 steps in a row (steps 1-10)" in lines[0]
    assert "training stopped at step 10" in lines[0]
    assert f"The last whole checkpoint is {out / 'checkpoint-8'}." in lines[0]
    assert "--zero_loss_patience 0" in lines[0]
    # the checkpoints before the stop are whole; nothing was saved at or after it
    assert find_last_complete_checkpoint(str(out)) == str(out / "checkpoint-8")
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-8"]
    assert all(is_complete(str(out / n)) for n in ("checkpoint-4", "checkpoint-8"))


def test_the_patience_is_a_flag_and_0_turns_it_off(minilm_path, tmp_path):
    r, out = _zero_run(minilm_path, tmp_path, "--max_steps", "12", "--zero_loss_patience", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert is_complete(str(out / "checkpoint-12"))


def test_zero_loss_stop_counts_steps_in_a_row():
    """The rule on its own: a step counts when every micro-batch's loss and the gradient norm
    are exactly 0; any other step starts the count again."""
    watch = ZeroLossStop(3)
    zero, some = torch.tensor(0.0), torch.tensor(0.5)

    def step(n, losses, grad_norm):
        for loss in losses:
            watch.saw_loss(loss, n)
        watch.saw_step(grad_norm, n, "out/checkpoint-1", "cpu")

    step(1, [zero, zero], 0.0)
    step(2, [zero, some], 0.0)  # one micro-batch with a loss: not counted
    step(3, [zero], 1e-3)  # a gradient: not counted
    step(4, [zero], None)  # no gradient norm computed: not counted
    step(5, [zero], 0.0)
    step(6, [zero, zero], 0.0)
    assert watch.run == 2
    with pytest.raises(ZeroLossError, match=r"for 3 steps in a row \(steps 5-7\).*stopped at step 7.*out/checkpoint-1"):
        step(7, [zero], 0.0)
    off = ZeroLossStop(0)
    for n in range(1, 50):
        off.saw_loss(zero, n)
        off.saw_step(0.0, n, None, "cpu")


RANK_LOSS = '''
import torch.distributed as dist

from mmembed.losses import EmbeddingLoss


class RankLoss(EmbeddingLoss):
    """No gradient anywhere; the loss is exactly 0 on rank 0 and 1.0 on rank 1 (``one``), or 0
    on both: only the processes together can tell whether the step's loss was 0."""

    def __init__(self, one: bool = True):
        super().__init__()
        self.one = one

    def forward(self, outputs, labels):
        zero = 0 * outputs["last_hidden_state"].sum()
        return zero + 1.0 if self.one and dist.get_rank() == 1 else zero
'''


@pytest.mark.parametrize("one", [True, False], ids=["rank1-loss-1", "both-0"])
def test_two_processes_agree(minilm_path, tmp_path, one):
    """Rank 0 alone sees loss 0 and gradient 0 on every step; it must not stop unless rank 1
    does too (else rank 1 would wait in the next collective for ever). Both 0: both stop at
    the same step, naming the same checkpoint."""
    (tmp_path / "rank_loss.py").write_text(RANK_LOSS)
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(8))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    argv = ["sft", "--model", minilm_path, "--dataset", data, "--loss_type", "rank_loss:RankLoss",
            "--loss_kwargs", json.dumps({"one": one}), "--per_device_train_batch_size", "1", "--max_steps", "6",
            "--zero_loss_patience", "3", "--save_steps", "2", "--max_length", "32", "--output_dir", str(out),
            "--report_to", "none", "--disable_tqdm", "true"]
    if one:  # torchrun's two workers, forked from the test server with its variables (tests/forked_cli.py)
        proc = run_ranks(["-m", "mmembed.tools.cli", *argv], 2, env=env, timeout=600, cwd=REPO)
    else:  # torchrun itself: both workers fail, and each must get to print its error before torchrun stops the other
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "mmembed.tools.cli", *argv], env=dict(os.environ, **env), capture_output=True,
                              text=True, cwd=REPO, timeout=600)
    if one:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert is_complete(str(out / "checkpoint-6"))
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = re.findall(r"mmembed sft: error: loss and gradient are exactly 0 for 3 steps in a row \(steps 1-3\): "
                        r"nothing is being learned; training stopped at step 3, nothing saved after it\. The last "
                        r"whole checkpoint is (\S+)\.", proc.stderr)
    assert errors == [str(out / "checkpoint-2")] * 2, proc.stderr[-3000:]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2"]
