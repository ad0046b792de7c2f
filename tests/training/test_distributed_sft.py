"""`mmembed sft` in two real processes (torchrun, gloo, CPU) under DDP, ZeRO-2/3 (offloaded
too) and with a gradient cache, against one process on the same global batch: one SGD step
with learning rate 1, so equal weights mean equal gradients. A file of its own so that the
two test workers (tests/run.sh) each take a share of the two-process runs."""

import json
import os

import numpy as np
import pytest
import torch
from test_distributed import _sft, _weights, one_process_run  # noqa: F401 (a fixture, shared with that file)


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (2, []),
        (2, ["--deepspeed", "zero2"]),
        (2, ["--deepspeed", "zero3"]),
        (2, ["--deepspeed", "zero2_offload"]),
        (2, ["--deepspeed", "zero3_offload"]),
        (1, ["--gradcache_mini_batch_size", "3"]),
        (2, ["--gradcache_mini_batch_size", "3"]),
        (2, ["--deepspeed", "zero2", "--gradcache_mini_batch_size", "3"]),
        (2, ["--deepspeed", "zero3", "--gradcache_mini_batch_size", "3"]),
    ],
    ids=["ddp", "zero2", "zero3", "zero2_offload", "zero3_offload", "gradcache", "ddp-gradcache", "zero2-gradcache", "zero3-gradcache"],
)
def test_sft_matches_one_plain_process_on_the_global_batch(minilm_no_dropout, one_process_run, tmp_path, nproc,  # noqa: F811
                                                           extra):
    """One SGD step with lr 1: the weight change is the gradient, so equal weights mean equal
    gradients. Two processes with batch 4 see the same global batch of 8 as one process with
    batch 8; the 5 eval rows split 3/2 between them. With a gradient cache the batch is
    embedded 3 rows at a time."""
    d = one_process_run
    two = str(tmp_path / "two")
    _sft(minilm_no_dropout, two, str(d / "train.jsonl"), str(d / "val.jsonl"), 8 // nproc, nproc, *extra)
    one = str(d / "out")
    w1, w2 = _weights(os.path.join(one, "checkpoint-1")), _weights(os.path.join(two, "checkpoint-1"))
    w0 = _weights(minilm_no_dropout)
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w1 if k in w0)
    assert moved > 1e-4  # the step did change the weights
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4, msg=k)
    s1 = json.load(open(os.path.join(one, "checkpoint-1", "trainer_state.json")))["log_history"]
    s2 = json.load(open(os.path.join(two, "checkpoint-1", "trainer_state.json")))["log_history"]
    loss1 = [h["loss"] for h in s1 if "loss" in h]
    loss2 = [h["loss"] for h in s2 if "loss" in h]
    assert loss2 == pytest.approx(loss1, abs=1e-4)
    e1 = [h for h in s1 if "eval_mean_pos" in h][0]
    e2 = [h for h in s2 if "eval_mean_pos" in h][0]
    for key in ("eval_mean_pos", "eval_mean_neg", "eval_margin", "eval_recall_at_1", "eval_ndcg_at_10"):
        assert e2[key] == pytest.approx(e1[key], abs=1e-5), key
    assert np.isfinite(e2["eval_loss"])
