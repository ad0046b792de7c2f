"""Two real processes (torchrun, gloo, CPU) against one process on the same global batch.

The claim under test (docs/distributed.md, "Several processes"): with cross-device negatives gathered
with gradient and the loss scaled by B_r * W / B, averaged parameter gradients equal those
of one process on the whole global batch, for equal and unequal per-process sizes.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DATA, REPO, free_port, launch

WORKER = os.path.join(REPO, "tests", "dist_loss_worker.py")


def _torchrun(args, env=None, nproc=2):
    return launch(args, nproc=nproc, env=env, timeout=600, torchrun=True)


# ---- loss level: a small linear encoder under DDP, every loss configuration ----------------

CONFIGS = [
    ("infonce", {}),
    ("infonce", {"include_qq": True, "include_dd": True}),
    ("infonce", {"mask_fake_negative": True, "fake_neg_margin": 0.0}),
    ("infonce", {"use_batch": False}),
    ("infonce", {"hard_negatives": 1}),
    ("cosine_similarity", {}),
    ("contrastive", {}),
    ("online_contrastive", {}),
    ("gist", {}),
    ("gist", {"margin": 0.1, "margin_strategy": "relative", "temperature": 0.05}),
    ("distill_kl", {"temperature": 0.05}),
    ("distill_kl", {"use_batch": False}),
    ("distill_kl", {"use_batch": False, "teacher_temperature": 1.0, "_teacher_scores": True}),
    ("distill_marginal", {"lam": 0.3}),
    ("distill_cosine", {}),
    ("distill_mse", {}),
    ("matryoshka", {"dims": {"3": 1.0, "5": 0.5}, "inner": "infonce", "include_qq": True}),
    ("matryoshka", {"dims": {"2": 0.5, "5": 1.0}, "inner": "gist"}),
    ("custom_loss:SymmetricInfoNCE", {}),  # a user's loss declaring nothing: the whole gathered batch
]


@pytest.mark.parametrize("split", ["equal", "unequal"])
def test_two_process_gradients_equal_one_process_global_batch(tmp_path, split):
    from dist_loss_worker import global_batch, reference_grads

    out = tmp_path / "grads.pt"
    _torchrun([WORKER, "--out", str(out), "--split", split, "--configs", json.dumps(CONFIGS)])
    got = torch.load(out)
    for i, (name, opts) in enumerate(CONFIGS):
        ref_loss, ref_grads = reference_grads(name, opts, *global_batch(name, opts))
        assert got[i]["loss"] == pytest.approx(ref_loss, abs=1e-5), (name, opts)
        for k, g in ref_grads.items():
            torch.testing.assert_close(got[i]["grads"][k], g, atol=1e-5, rtol=1e-4, msg=f"{name} {opts} {k}")
        assert any(g.abs().max() > 1e-3 for g in ref_grads.values())  # gradients are not trivially zero


# ---- trainer level: `mmembed sft` on a real model, 2 processes vs 1 ------------------------

def _rows(n_train, n_val):
    with open(os.path.join(DATA, "stsb_train_hardneg.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][: n_train + n_val]
    for i, r in enumerate(rows):  # 0, 1 or 2 negatives per row
        r["rejected_response"] = [rows[(i + 5) % len(rows)]["response"]][: i % 2] + ([rows[(i + 9) % len(rows)]["query"]] if i % 3 == 0 else [])
    return rows[:n_train], rows[n_train:]


def _sft(model, out, train, val, per_device, nproc, *extra):
    args = ["-m", "mmembed.tools.cli", "sft", "--model", model, "--dataset", train, "--val_dataset", val,
            "--tuner_type", "full", "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", "1",
            "--per_device_eval_batch_size", "2", "--max_steps", "1", "--save_steps", "1", "--eval_steps", "1",
            "--optim", "sgd", "--learning_rate", "1.0", "--weight_decay", "0", "--max_grad_norm", "0",
            "--lr_scheduler_type", "constant", "--gradient_checkpointing", "false", "--max_length", "48",
            "--seed", "3", "--output_dir", out, "--disable_tqdm", "true", "--dataloader_num_workers", "0", *extra]
    if nproc == 1:
        launch(args)  # one forked process of the command line (tests/forked_cli.py), OMP_NUM_THREADS kept or 2
    else:
        _torchrun(args, nproc=nproc)


@pytest.fixture(scope="module")
def one_process_run(minilm_no_dropout, tmp_path_factory):
    """8 training rows = one global batch, trained by one process with batch 8; 5 eval rows."""
    d = tmp_path_factory.mktemp("one")
    train, val = _rows(8, 5)
    for name, rows in (("train", train), ("val", val)):
        with open(d / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    _sft(minilm_no_dropout, str(d / "out"), str(d / "train.jsonl"), str(d / "val.jsonl"), 8, 1)
    return d


def _weights(folder):
    """The saved tensors, LayerNorm names normalized: a ZeRO-3 save keeps this checkpoint's
    original BERT spelling (gamma/beta), which transformers maps to weight/bias on load."""
    from safetensors.torch import load_file

    raw = load_file(os.path.join(folder, "model.safetensors"))
    return {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v for k, v in raw.items()}


@pytest.mark.parametrize("stage, nproc_env", [("zero2", None), ("zero3", "1")], ids=["zero2", "zero3-NPROC_PER_NODE=1"])
def test_one_process_deepspeed_from_the_cli_equals_one_plain_process(minilm_no_dropout, one_process_run, tmp_path,
                                                                      monkeypatch, stage, nproc_env):
    """`mmembed sft --deepspeed zero2|zero3` in one process, started as a user starts it (no
    torchrun; NPROC_PER_NODE unset or 1): DeepSpeed needs a process group, which used to fail
    looking for MPI ("No module named 'mpi4py'"). The step equals the plain one-process run."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    if nproc_env:
        monkeypatch.setenv("NPROC_PER_NODE", nproc_env)
    out = str(tmp_path / "ds")
    _sft(minilm_no_dropout, out, str(one_process_run / "train.jsonl"), str(one_process_run / "val.jsonl"), 8, 1,
         "--deepspeed", stage)
    w1, w2 = _weights(os.path.join(one_process_run, "out", "checkpoint-1")), _weights(os.path.join(out, "checkpoint-1"))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4, msg=k)


ACCUMULATION = ["--gradient_accumulation_steps", "2", "--eval_strategy", "no"]


@pytest.fixture(scope="module")
def plain_accumulation_run(minilm_no_dropout, one_process_run, tmp_path_factory):
    """DDP, 2 processes x batch 2 x 2 accumulation steps: one step over the same 8 groups."""
    d = one_process_run
    out = str(tmp_path_factory.mktemp("accumulation") / "plain")
    _sft(minilm_no_dropout, out, str(d / "train.jsonl"), str(d / "val.jsonl"), 2, 2, *ACCUMULATION)
    return out


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_gradcache_under_deepspeed_with_accumulation_and_uneven_chunk_counts(
        minilm_no_dropout, one_process_run, plain_accumulation_run, tmp_path, stage):
    """2 processes x batch 2 x 2 accumulation steps, a gradient cache of 1 row under ZeRO-2/3,
    equal the plain DDP run with the same micro-batches: each micro-batch's gradient is
    divided by the accumulation steps once (not by the Trainer and the engine both, and the
    plain step is divided too). The 8 groups have 23 rows, an odd number, so in some
    micro-step the two processes hold different numbers of rows, hence of 1-row chunks:
    the process with fewer runs extra passes with a zero gradient, since ZeRO-2/3 reduce in
    every backward and ZeRO-3 gathers parameters in every forward."""
    d = one_process_run
    cached = str(tmp_path / "cached")
    _sft(minilm_no_dropout, cached, str(d / "train.jsonl"), str(d / "val.jsonl"), 2, 2, *ACCUMULATION,
         "--deepspeed", stage, "--gradcache_mini_batch_size", "1")
    w1 = _weights(os.path.join(plain_accumulation_run, "checkpoint-1"))
    w2 = _weights(os.path.join(cached, "checkpoint-1"))
    w0 = _weights(minilm_no_dropout)
    assert max((w1[k] - w0[k]).abs().max().item() for k in w1 if k in w0) > 1e-4
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4, msg=k)


def _launch_env(**kw):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", **{k: str(v) for k, v in kw.items()})
    return env


def test_nproc_per_node_relaunches_under_torchrun(minilm_no_dropout, tmp_path):
    """ms-swift's habit: NPROC_PER_NODE=2 mmembed sft ... runs two processes; the result equals
    the torchrun run of the test above (same global batch, same single step)."""
    train, val = _rows(8, 5)
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "mmembed.tools.cli", "sft", "--model", minilm_no_dropout, "--dataset", str(tmp_path / "train.jsonl"),
            "--tuner_type", "full", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
            "--max_steps", "1", "--save_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--weight_decay", "0",
            "--max_grad_norm", "0", "--lr_scheduler_type", "constant", "--gradient_checkpointing", "false",
            "--max_length", "48", "--seed", "3", "--disable_tqdm", "true"]
    proc = subprocess.run(args + ["--output_dir", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=_launch_env(NPROC_PER_NODE=2, MASTER_PORT=free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.load(open(out / "checkpoint-1" / "trainer_state.json"))
    assert state["epoch"] == 1.0  # 8 rows, 2 processes x 4: one step is the whole epoch

    # two nodes on loopback: two launchers with one process each
    port = free_port()
    procs = [subprocess.Popen(args + ["--output_dir", str(tmp_path / "nodes")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, env=_launch_env(NPROC_PER_NODE=1, NNODES=2, NODE_RANK=r,
                                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    from safetensors.torch import load_file

    a = load_file(str(out / "checkpoint-1" / "model.safetensors"))
    b = load_file(str(tmp_path / "nodes" / "checkpoint-1" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)


ZERO3_LORA = ["--deepspeed", "zero3", "--tuner_type", "lora", "--eval_strategy", "no", "--lora_dropout", "0"]


@pytest.fixture(scope="module")
def zero3_lora_whole(minilm_no_dropout, one_process_run, tmp_path_factory):
    """ZeRO-3 with LoRA, 2 processes, 2 steps, a checkpoint after each: the uninterrupted run
    that the resume tests compare against (its checkpoint-1 is also where --resume_only_model
    starts from)."""
    d = one_process_run
    whole = str(tmp_path_factory.mktemp("zero3_lora") / "whole")
    _sft(minilm_no_dropout, whole, str(d / "train.jsonl"), str(d / "val.jsonl"), 2, 2, *ZERO3_LORA,
         "--max_steps", "2", "--save_steps", "1")
    return whole


def test_zero3_lora_run_killed_after_a_checkpoint_resumes_to_the_same_weights(minilm_no_dropout, one_process_run,
                                                                              zero3_lora_whole, tmp_path):
    """ZeRO-3 with LoRA, 2 processes: a run stopped after checkpoint-1 and resumed with
    --resume_from_checkpoint true ends with the adapter of the uninterrupted run; the
    adapter exports to a plain folder."""
    from safetensors.torch import load_file

    d = one_process_run
    whole, killed = zero3_lora_whole, tmp_path / "killed"
    shutil.copytree(os.path.join(whole, "checkpoint-1"), killed / "checkpoint-1")
    _sft(minilm_no_dropout, str(killed), str(d / "train.jsonl"), str(d / "val.jsonl"), 2, 2, *ZERO3_LORA,
         "--max_steps", "2", "--save_steps", "1", "--resume_from_checkpoint", "true")
    a = load_file(os.path.join(whole, "checkpoint-2", "adapter_model.safetensors"))
    b = load_file(str(killed / "checkpoint-2" / "adapter_model.safetensors"))
    first = load_file(os.path.join(whole, "checkpoint-1", "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], first[k]) for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)

    from mmembed.model.embedder import Embedder
    from mmembed.tools.export import export_checkpoint

    merged = export_checkpoint(str(killed / "checkpoint-2"), str(tmp_path / "merged"))
    texts = ["A man is playing a flute.", "Two dogs run in the snow."]
    np.testing.assert_allclose(Embedder.from_pretrained(merged).encode(texts),
                               Embedder.from_pretrained(str(killed / "checkpoint-2")).encode(texts), atol=1e-5)


@pytest.mark.parametrize("stage", ["zero2_offload", "zero3_offload"])
def test_lora_under_offload_configs_trains_and_exports(minilm_no_dropout, one_process_run, tmp_path, stage):
    """LoRA with the default optimizer (AdamW) under the bundled offload configs: the adapter
    moves, and the exported folder embeds like the checkpoint."""
    from mmembed import Embedder

    d = one_process_run
    out = tmp_path / "out"
    _torchrun(["-m", "mmembed.tools.cli", "sft", "--model", minilm_no_dropout, "--dataset", str(d / "train.jsonl"),
               "--tuner_type", "lora", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
               "--max_steps", "2", "--save_steps", "2", "--learning_rate", "1e-3", "--deepspeed", stage,
               "--output_dir", str(out), "--disable_tqdm", "true", "--report_to", "none"])
    ckpt = out / "checkpoint-2"
    from safetensors.torch import load_file

    adapter = load_file(str(ckpt / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B starts at zero
    launch(["-m", "mmembed.tools.cli", "export", "--adapters", str(ckpt), "--merge_lora", "true"])  # asserts exit 0
    texts = ["A man plays a flute.", "Someone is cooking."]
    a = Embedder.from_pretrained(str(ckpt)).encode(texts)
    b = Embedder.from_pretrained(str(ckpt) + "-merged").encode(texts)
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def zero3_best_run(minilm_no_dropout, one_process_run, tmp_path_factory):
    """Full tuning under ZeRO-3 on 2 processes, 3 steps with an evaluation and a checkpoint
    after each and --load_best_model_at_end: (output folder, the metrics it printed last). Its
    checkpoint-1 is also where the full --resume_only_model test starts from."""
    d = one_process_run
    out = tmp_path_factory.mktemp("zero3_best") / "out"
    # on these rows (ms-swift's data order, --data_seed 42) the eval loss rises as it trains, so
    # the lowest (greater_is_better false, the natural choice) is an early checkpoint
    proc = _torchrun(["-m", "mmembed.tools.cli", "sft", "--model", minilm_no_dropout, "--dataset", str(d / "train.jsonl"),
                      "--val_dataset", str(d / "val.jsonl"), "--tuner_type", "full", "--deepspeed", "zero3",
                      "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", "3",
                      "--learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--eval_steps", "1",
                      "--save_steps", "1", "--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss",
                      "--greater_is_better", "false", "--output_dir", str(out), "--disable_tqdm", "true",
                      "--report_to", "none"])
    return out, json.loads(proc.stdout[proc.stdout.index("{\n"):proc.stdout.rindex("}") + 1])


def test_best_checkpoint_is_reloaded_under_zero3(zero3_best_run):
    """--load_best_model_at_end with ZeRO-3 on 2 processes: the engine reloads the picked
    checkpoint (its partitioned parameters cannot take a plain state dict), so the final
    evaluation repeats that checkpoint's logged numbers, not the last step's."""
    out, metrics = zero3_best_run
    history = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    logged = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}
    best = min(logged, key=logged.get)
    assert best != 3 and metrics["best_model_checkpoint"] == str(out / f"checkpoint-{best}"), logged
    assert metrics["eval_loss"] == pytest.approx(logged[best], rel=1e-5)
    assert metrics["eval_loss"] != pytest.approx(logged[3], rel=1e-4)


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_resume_only_model_under_zero3_takes_the_weights(minilm_no_dropout, one_process_run, request, tmp_path, tuner):
    """--resume_only_model with ZeRO-3 on 2 processes: the checkpoint's weights reach the
    partitioned parameters (learning rate 0: the next checkpoint holds them unchanged) and the
    step count goes on, while the engine's optimizer state is not read. The first checkpoint
    is that of a ZeRO-3 run of this file: the full best-checkpoint run's, the LoRA resume's."""
    from safetensors.torch import load_file

    d = one_process_run
    first = str(request.getfixturevalue("zero3_best_run")[0]) if tuner == "full" else \
        request.getfixturevalue("zero3_lora_whole")
    second = str(tmp_path / "second")
    _sft(minilm_no_dropout, second, str(d / "train.jsonl"), str(d / "val.jsonl"), 2, 2, "--deepspeed", "zero3",
         "--tuner_type", tuner, "--eval_strategy", "no", "--lora_dropout", "0", "--max_steps", "2",
         "--learning_rate", "0", "--resume_from_checkpoint", os.path.join(first, "checkpoint-1"),
         "--resume_only_model", "true")
    name = "model.safetensors" if tuner == "full" else "adapter_model.safetensors"
    a = load_file(os.path.join(first, "checkpoint-1", name))
    b = load_file(os.path.join(second, "checkpoint-2", name))
    base = load_file(os.path.join(minilm_no_dropout, "model.safetensors"))
    moved = [k for k in a if k in base and not torch.allclose(a[k], base[k])] if tuner == "full" else \
        [k for k in a if "lora_B" in k and a[k].abs().max() > 0]
    assert moved  # the first run changed the weights, so loading them is visible
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)
