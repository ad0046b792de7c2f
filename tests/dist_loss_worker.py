"""Worker for tests/test_distributed.py, run under torchrun: a small linear encoder in DDP,
each process holding its share of one global batch; also the one-process reference."""

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from mmembed.losses import build_loss  # noqa: E402
from mmembed.training.distributed import GlobalBatchLoss  # noqa: E402

D_IN, D = 6, 5
NEG_COUNTS = [2, 0, 1, 3, 1, 2, 0, 1]  # 8 groups, unequal negatives
PAIR_LOSSES = ("cosine_similarity", "contrastive", "online_contrastive")


def encoder() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(D_IN, D).double()


def global_batch(name: str, opts: dict | None = None):
    """(inputs [N, D_IN], labels, group_of_row [N]) in ms-swift's layout for the whole batch."""
    g = torch.Generator().manual_seed(1)
    if name in PAIR_LOSSES:
        n_pairs = len(NEG_COUNTS)
        x = torch.randn(2 * n_pairs, D_IN, generator=g, dtype=torch.float64)
        if name == "cosine_similarity":
            labels = torch.rand(n_pairs, generator=g, dtype=torch.float64)
        else:
            labels = torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0], dtype=torch.float64)
        return x, labels, torch.arange(n_pairs).repeat_interleave(2)
    counts = [max(1, c) for c in NEG_COUNTS] if (opts or {}).get("hard_negatives") else NEG_COUNTS
    rows, labels, group = 0, [], []
    for gi, c in enumerate(counts):
        labels += [1.0] + [0.0] * c
        group += [gi] * (2 + c)
        rows += 2 + c
    x = torch.randn(rows, D_IN, generator=g, dtype=torch.float64)
    return x, torch.tensor(labels, dtype=torch.float64), torch.tensor(group)


def embed(model, x):
    return F.normalize(model(x), dim=-1)


def side_embeddings(n_rows: int) -> dict[str, torch.Tensor]:
    """A guide's (width 4) and a teacher's (width D) embeddings of the global batch's rows."""
    g = torch.Generator().manual_seed(2)
    return {"guide_hidden_state": F.normalize(torch.randn(n_rows, 4, generator=g, dtype=torch.float64), dim=-1),
            "teacher_hidden_state": F.normalize(torch.randn(n_rows, D, generator=g, dtype=torch.float64), dim=-1)}


def teacher_scores(counts: list[int]) -> torch.Tensor:
    """A teacher's scores of each group's own candidates (positive, then negatives), NaN-padded."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(len(counts), 1 + max(counts), generator=g, dtype=torch.float64)
    for i, c in enumerate(counts):
        scores[i, 1 + c:] = float("nan")
    return scores


def side_inputs(opts: dict, x, group) -> tuple[dict, dict[str, torch.Tensor]]:
    """The loss's options, and the side outputs of the global batch: a guide's and a
    teacher's embeddings, or (option ``_teacher_scores``) the teacher's per-group scores."""
    opts = dict(opts)
    if opts.pop("_teacher_scores", False):
        return opts, {"teacher_scores": teacher_scores(torch.bincount(group).sub(2).tolist())}
    return opts, side_embeddings(x.shape[0])


def reference_grads(name, opts, x, labels, group):
    model = encoder()
    opts, side = side_inputs(opts, x, group)
    loss = build_loss(name, **opts)({"last_hidden_state": embed(model, x), **side}, labels)
    loss.backward()
    return loss.item(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def shard(name, opts, x, labels, group, groups_of_rank):
    """This process's rows (whole groups / pairs), their labels and side outputs, and the
    loss's options."""
    rows = torch.isin(group, torch.tensor(groups_of_rank))
    opts, side = side_inputs(opts, x, group)
    side = {k: v[groups_of_rank] if k == "teacher_scores" else v[rows] for k, v in side.items()}
    if name not in PAIR_LOSSES:
        non_anchor = torch.ones_like(group, dtype=torch.bool)
        first = torch.cat([torch.tensor([True]), group[1:] != group[:-1]])
        non_anchor[first] = False
        lab = labels[rows[non_anchor]]
    else:
        lab = labels[torch.tensor(groups_of_rank)]
    return x[rows], lab, side, opts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--split", choices=["equal", "unequal"], required=True)
    p.add_argument("--configs", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cut = 4 if a.split == "equal" else 3
    mine = list(range(cut)) if rank == 0 else list(range(cut, len(NEG_COUNTS)))
    results = []
    for name, opts in json.loads(a.configs):
        x, labels, group = global_batch(name, opts)
        xs, ls, side, opts = shard(name, opts, x, labels, group, mine)
        model = nn.parallel.DistributedDataParallel(encoder())
        loss = GlobalBatchLoss(build_loss(name, **opts))({"last_hidden_state": embed(model, xs), **side}, ls)
        loss.backward()  # DDP averages the parameter gradients over the processes
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        results.append({"loss": reported.item() / dist.get_world_size(),
                        "grads": {k.removeprefix("module."): p.grad.detach().clone() for k, p in model.named_parameters()}})
    if rank == 0:
        torch.save(results, a.out)
    # the DDP wrappers hold the process group: free them first, so that destroy_process_group
    # really ends gloo's threads here rather than in the interpreter's teardown, where under
    # load one of them was seen to abort the process ("terminate called without an active exception")
    del model, loss
    gc.collect()
    dist.barrier()  # leave together: a process exiting mid-teardown can abort its peer
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing is left to clean up; skip the C++ destructors of interpreter exit


if __name__ == "__main__":
    main()
