"""``--task_type late_interaction`` with a gradient cache and across processes, against
references written out here, on the real all-MiniLM-L6-v2:

- the gradient-cache step (``--gradcache_mini_batch_size 2``) leaves the same gradients, in the
  backbone and the projection, as the plain step, and both equal ``loss.backward()`` of InfoNCE
  over MaxSim written out in this file (rows of very different lengths, so the chunks are cut to
  different token widths); with dropout on, the cached step equals the chunked reference whose
  chunks draw their masks in the same order (the RNG replay);
- two processes (torchrun, gloo, CPU) under plain DDP, ZeRO-2 and ZeRO-3, two SGD steps, end with
  the weights (backbone and projection) of one process on the same global batches; under ZeRO-3
  the projection is partitioned, and the checkpoint's ``late_interaction_projection.safetensors``
  must still hold the whole ``[128, 384]`` weight. The negatives gathered from the other process
  carry their gradient home: a run whose gather keeps only the local gradient
  (tests/li_dist_worker.py) does not end with one process's weights (the check can fail).

The loss-level check (a toy token encoder, every late-interaction loss, two processes with
different token widths) is tests/training/test_maxsim_distributed.py; this file does not repeat it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import launch, stsb_pairs, write_jsonl

from mmembed.training.arguments import parse_sft_args
from mmembed.training.sft import build_trainer

ATOL, RTOL = 1e-5, 1e-5


# ----------------------------------------------------------------------------- data


def _rows(n: int) -> list[dict]:
    """Query / positive rows with 0, 1 or 2 hard negatives; every second document is long (five
    sentences joined) and every third query two words, so the rows' token widths differ widely
    (and two processes hold different numbers of rows: 11 and 13, then 10 and 12)."""
    pairs = stsb_pairs(6 * n + 3)
    rows = []
    for i in range(n):
        query = pairs[i]["query"]
        if i % 3 == 1:
            query = " ".join(query.split()[:2])  # a two-word query
        response = pairs[i]["response"]
        if i % 2 == 0:  # a long document (five sentences joined): 50-90 tokens
            response = " ".join([response] + [pairs[k * n + i]["response"] for k in range(2, 6)])
        negatives = [pairs[(i + 5) % n]["response"]][: i % 2] + ([pairs[n + i + 1]["query"]] if i % 3 == 0 else [])
        rows.append({"query": query, "response": response, "rejected_response": negatives})
    return rows


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("li_dist") / "train.jsonl", _rows(16))


# ----------------------------------------------------------------------------- reference loss


def maxsim_reference(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """ColBERT's score of one query ``[Lq, D]`` and one document ``[Ld, D]`` (token vectors,
    absent ones exactly zero): over the present query tokens, the sum of the largest dot product
    with a present document token."""
    q = q[q.ne(0).any(-1)]
    d = d[d.ne(0).any(-1)]
    return (q @ d.T).max(1).values.sum()


def infonce_reference(reps: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """ms-swift's InfoNCE (use_batch) over MaxSim: rows ``a0, p0, n0_*, a1, p1, ...``, labels
    one per non-anchor row (1.0 positive, 0.0 negative); each anchor's logits are its scores
    against every document of the batch, the target its own positive; the mean over anchors."""
    anchors, docs, positive_of = [], [], []
    row = 0
    for y in labels.tolist():
        if y == 1.0:  # a group starts: its anchor precedes its positive
            anchors.append(row)
            row += 1
            positive_of.append(len(docs))
        docs.append(row)
        row += 1
    assert row == reps.shape[0]
    losses = []
    for a, target in zip(anchors, positive_of):
        logits = torch.stack([maxsim_reference(reps[a], reps[d]) for d in docs]) / temperature
        losses.append(-torch.log_softmax(logits, 0)[target])
    return torch.stack(losses).mean()


# ----------------------------------------------------------------------------- 1. the gradient cache


def _trainer(model, train, out, *extra):
    args = parse_sft_args(["--model", model, "--task_type", "late_interaction", "--dataset", train,
                           "--output_dir", str(out), "--per_device_train_batch_size", "6", "--max_steps", "1",
                           "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
                           "--tuner_type", "full", "--max_length", "96", *extra])
    trainer = build_trainer(args)
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which this test steps outside of
    return trainer


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    assert "projection.weight" in want and any(k.startswith("backbone.") for k in want)
    assert float(want["projection.weight"].abs().max()) > 1e-3, "the projection's gradient is trivial"
    for name, w in want.items():
        # torch.testing.assert_close's rule written out (it is slow on the 30522 x 384 embedding)
        worst = float(((got[name] - w).abs() - (ATOL + RTOL * w.abs())).max())
        assert worst <= 0, f"{what}: {name}: |got - want| exceeds {ATOL} + {RTOL} * |want| by {worst:.3g}"


@pytest.fixture(scope="module")
def gradcache_trainers(minilm_path, train_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("li_gradcache")
    torch.manual_seed(0)  # the projection's draw (run_sft seeds it; build_trainer alone does not): one fixed case
    plain = _trainer(minilm_path, train_file, root / "plain")
    cached = _trainer(minilm_path, train_file, root / "cached", "--gradcache_mini_batch_size", "2")
    cached.model.load_state_dict(plain.model.state_dict())  # the projection starts random: the same on both
    assert cached.gradcache_mini_batch_size == 2 and not plain.gradcache_mini_batch_size
    samples = [plain.train_dataset[i] for i in range(6)]
    batch = plain.data_collator(samples)
    return plain, cached, batch


def _model_inputs(batch):
    """The model's inputs of a collated batch (not its labels, nor the rows' dataset ids)."""
    from mmembed.encoding.collator import CollatedBatch

    return CollatedBatch.unpack(dict(batch)).inputs


def test_the_cached_step_gives_the_plain_steps_and_the_written_out_gradients(gradcache_trainers):
    """Dropout off: the plain training step, the cached one (2 rows a chunk) and
    ``loss.backward()`` of the InfoNCE-over-MaxSim reference leave the same gradients."""
    plain, cached, batch = gradcache_trainers
    n = batch["input_ids"].shape[0]
    # rows of very different lengths: the 2-row chunks (rows sorted by length) are cut to
    # different token widths inside the model
    spans = (batch["attention_mask"].bool() | batch["token_mask"].bool()).sum(1)
    order = torch.argsort(batch["attention_mask"].sum(1), stable=True)
    widths = [int(spans[order[i:i + 2]].max()) for i in range(0, n, 2)]
    assert len(set(widths)) >= 3 and max(widths) > 40, widths
    assert n >= 12 and batch["token_mask"][~batch["apply_skiplist"]].sum(1).eq(32).all()  # ColBERT queries
    dropouts = [m for t in (plain, cached) for m in t.model.modules() if isinstance(m, torch.nn.Dropout)]
    rates = [m.p for m in dropouts]
    for m in dropouts:  # no dropout here: the plain step draws its masks over the whole batch, the cache per chunk
        m.p = 0.0
    try:
        reps = plain.model.train()(**_model_inputs(batch))["last_hidden_state"]
        loss = infonce_reference(reps, batch["labels"])
        loss.backward()
        reference = _grads(plain.model)
        step_loss = plain.training_step(plain.model, dict(batch))
        assert abs(float(step_loss) - float(loss.detach())) < 1e-5
        _assert_grads_close(_grads(plain.model), reference, "plain step")
        cached_loss = cached.training_step(cached.model, dict(batch))
        assert abs(float(cached_loss) - float(loss.detach())) < 1e-5
        _assert_grads_close(_grads(cached.model), reference, "cached step")
    finally:
        for m, p in zip(dropouts, rates):
            m.p = p


def test_with_dropout_the_cached_step_replays_each_chunks_masks(gradcache_trainers):
    """Dropout on: the cached step equals the reference that embeds the same 2-row chunks
    (rows sorted by length, as the cache cuts them) with graph one after another from the same
    seed, then ``loss.backward()``; this holds only if each chunk's second forward replays the
    dropout masks of its first."""
    _, cached, batch = gradcache_trainers
    model = cached.model
    model.train()
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    inputs = _model_inputs(batch)
    n = inputs["input_ids"].shape[0]
    order = torch.argsort(inputs["attention_mask"].sum(1), stable=True)
    torch.manual_seed(5)
    parts = [model(**{k: v[order[i:i + 2]] for k, v in inputs.items()})["last_hidden_state"] for i in range(0, n, 2)]
    reps = torch.cat(parts)[torch.argsort(order)]
    loss = infonce_reference(reps, batch["labels"])
    loss.backward()
    reference = _grads(model)
    torch.manual_seed(5)
    cached_loss = cached.training_step(model, dict(batch))
    assert abs(float(cached_loss) - float(loss.detach())) < 1e-5
    _assert_grads_close(_grads(model), reference, "cached step with dropout")


# ----------------------------------------------------------------------------- 2-3. processes


def _sft(model, train, out, per_device, nproc, *extra, worker: str | None = None):
    """``mmembed sft --task_type late_interaction``: two SGD steps (lr 0.05), a checkpoint and a
    logged loss after each; ``worker``: a script run in the processes instead of the command line."""
    flags = ["--model", model, "--task_type", "late_interaction", "--dataset", train,
             "--tuner_type", "full", "--per_device_train_batch_size", str(per_device),
             "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_steps", "1", "--eval_strategy", "no",
             "--optim", "sgd", "--learning_rate", "0.05", "--weight_decay", "0", "--max_grad_norm", "0",
             "--lr_scheduler_type", "constant", "--gradient_checkpointing", "false", "--max_length", "96",
             "--seed", "3", "--output_dir", str(out), "--disable_tqdm", "true", "--dataloader_num_workers", "0",
             "--logging_steps", "1", "--report_to", "none", *extra]
    args = [worker, *flags] if worker else ["-m", "mmembed.tools.cli", "sft", *flags]
    launch(args, nproc=nproc, timeout=600, torchrun=nproc > 1)
    return str(out)


def _normalized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LayerNorm names as transformers loads them: a ZeRO-3 save keeps this checkpoint's BERT
    spelling (gamma / beta)."""
    return {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
            for k, v in state.items()}


def _weights(folder) -> dict[str, torch.Tensor]:
    """A checkpoint's backbone tensors and its projection, as ``projection``."""
    from safetensors.torch import load_file

    weights = _normalized(load_file(os.path.join(folder, "model.safetensors")))
    projection = load_file(os.path.join(folder, "late_interaction_projection.safetensors"))
    assert set(projection) == {"linear.weight"}
    weights["projection"] = projection["linear.weight"]
    return weights


def _losses(folder) -> list[float]:
    history = json.load(open(os.path.join(folder, "checkpoint-2", "trainer_state.json")))["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def _worst_excess(got: dict, want: dict) -> tuple[float, str]:
    """The largest amount by which ``|got - want|`` exceeds 1e-5 + 1e-4 * ``|want|`` (<= 0: within)."""
    return max((float(((got[k] - w).abs() - (1e-5 + 1e-4 * w.abs())).max()), k) for k, w in want.items())


@pytest.fixture(scope="module")
def one_process_li(minilm_no_dropout, train_file, tmp_path_factory):
    """One process, batch 8: the two global batches of 8 groups."""
    return _sft(minilm_no_dropout, train_file, tmp_path_factory.mktemp("li_one") / "out", 8, 1)


@pytest.mark.parametrize("extra", [[], ["--deepspeed", "zero2"], ["--deepspeed", "zero3"]],
                         ids=["ddp", "zero2", "zero3"])
def test_two_processes_end_with_one_processs_weights_and_projection(minilm_no_dropout, train_file, one_process_li,
                                                                    tmp_path, extra):
    """Two processes with batch 4 see the global batches of one process with batch 8 (ms-swift's
    order: process r takes every second row); the other process's rows are gathered with their
    gradient, so after each of two SGD steps the weights and the projection are one process's
    (1e-5 + 1e-4 * |w|), and so is each step's loss. Both steps move the backbone and the
    projection by far more than that. Under ZeRO-3 each process holds half of every parameter:
    the saved projection must be the whole gathered [128, 384] weight."""
    from safetensors.torch import load_file

    two = _sft(minilm_no_dropout, train_file, tmp_path / "two", 4, 2, *extra)
    if extra:  # DeepSpeed ran: the partitioned optimizer state of each of the two processes
        assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(
            os.listdir(os.path.join(two, "checkpoint-1", "global_step1")))
    before = _normalized(load_file(os.path.join(minilm_no_dropout, "model.safetensors")))
    for step in (1, 2):
        w1 = _weights(os.path.join(one_process_li, f"checkpoint-{step}"))
        w2 = _weights(os.path.join(two, f"checkpoint-{step}"))
        assert w2["projection"].shape == (128, 384) and w2["projection"].dtype == torch.float32
        assert w1.keys() == w2.keys()
        moved = max(float((w1[k] - before[k]).abs().max()) for k in before if k in w1)
        assert moved > 1e-3, f"step {step}: the backbone hardly moved ({moved:.3g})"
        excess, name = _worst_excess(w2, w1)
        assert excess <= 0, f"checkpoint-{step}: {name} differs from one process's by {excess:.3g} over the tolerance"
        before = w1
    projections = [_weights(os.path.join(one_process_li, f"checkpoint-{step}"))["projection"] for step in (1, 2)]
    projection_moved = float((projections[1] - projections[0]).abs().max())
    assert projection_moved > 1e-4, f"step 2 hardly moved the projection ({projection_moved:.3g})"
    assert _losses(two) == pytest.approx(_losses(one_process_li), abs=1e-5) and len(_losses(two)) == 2


def test_without_the_other_processs_gradient_the_weights_differ(minilm_no_dropout, train_file, one_process_li,
                                                                 tmp_path):
    """The check above can fail: when each process keeps only its own loss term's gradient for
    its rows (tests/li_dist_worker.py: no all-reduce in the gather's backward, so the negatives one
    process holds carry no gradient from the other's queries), the loss is the same but the
    weights after the first step are not one process's."""
    from conftest import REPO

    two = _sft(minilm_no_dropout, train_file, tmp_path / "two", 4, 2,
               worker=os.path.join(REPO, "tests", "li_dist_worker.py"))
    assert _losses(two)[0] == pytest.approx(_losses(one_process_li)[0], abs=1e-5)
    w1 = _weights(os.path.join(one_process_li, "checkpoint-1"))
    w2 = _weights(os.path.join(two, "checkpoint-1"))
    excess, name = _worst_excess(w2, w1)
    assert excess > 1e-3, (excess, name)
    excess, name = _worst_excess({"projection": w2["projection"]}, {"projection": w1["projection"]})
    assert excess > 1e-4, (excess, name)
