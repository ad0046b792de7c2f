"""Late interaction (MaxSim over [N, L, D] token vectors) across two real processes (torchrun,
gloo, CPU), and under GradCache, against one plain process on the whole batch.

Each process holds its own groups padded to its own length L (the two differ), as a collator
pads each process's batch; ``mmembed.training.distributed`` pads L with zero (absent) tokens
to the longest before gathering. After DDP averages the gradients, they must equal those of
one process computing the loss on the global batch. This file is also the worker
(``python tests/training/test_maxsim_distributed.py --out FILE`` under torchrun).
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from mmembed.losses import build_loss

D_IN, D, L = 5, 4, 7
NEG_COUNTS = [2, 0, 1, 3, 1]  # groups 0-1 on rank 0, 2-4 on rank 1
CUT = 2
CONFIGS = [
    ("late_interaction_infonce", {"temperature": 0.5}),
    ("late_interaction_infonce", {"temperature": 0.1, "normalize_scores": True, "include_qq": True,
                                  "include_dd": True}),
    ("late_interaction_infonce", {"temperature": 0.5, "mask_fake_negative": True, "fake_neg_margin": 0.0}),
    ("late_interaction_infonce", {"temperature": 0.5, "use_batch": False}),
    ("colbert_pairwise_ce", {}),
    ("colbert_negative_ce", {"temperature": 0.2}),
    ("colbert_negative_ce", {"temperature": 0.2, "in_batch_term_weight": 0.0}),
    ("colbert_pairwise_negative_ce", {"temperature": 0.2}),
]


class TokenEncoder(nn.Module):
    """A per-token linear map, L2-normalised per token, absent tokens (mask 0) exactly zero."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(D_IN, D).double()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        width = int(attention_mask.sum(1).max())  # each call pads to its own longest row
        x, mask = input_ids[:, :width], attention_mask[:, :width]
        return {"last_hidden_state": F.normalize(self.proj(x), dim=-1) * mask[..., None]}


def global_batch():
    """(token features [N, L, D_IN], mask [N, L], labels, group of each row) in ms-swift's layout."""
    g = torch.Generator().manual_seed(1)
    labels, group = [], []
    for gi, c in enumerate(NEG_COUNTS):
        labels += [1.0] + [0.0] * c
        group += [gi] * (2 + c)
    n = len(group)
    x = torch.randn(n, L, D_IN, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, L + 1, (n,), generator=g)
    lengths[: 2 + NEG_COUNTS[0] + 2 + NEG_COUNTS[1]] = torch.randint(1, 4, (2 + NEG_COUNTS[0] + 2 + NEG_COUNTS[1],),
                                                                        generator=g)  # rank 0's rows: shorter
    mask = (torch.arange(L)[None, :] < lengths[:, None]).double()
    mask[3, 0] = 0.0  # a masked-out token inside a row
    mask[3, 1] = 1.0
    return x, mask, torch.tensor(labels, dtype=torch.float64), torch.tensor(group)


def reference_grads(name, opts):
    model = TokenEncoder()
    x, mask, labels, _ = global_batch()
    loss = build_loss(name, **opts)(model(x, mask), labels)
    loss.backward()
    return loss.item(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def shard(rank):
    x, mask, labels, group = global_batch()
    rows = group < CUT if rank == 0 else group >= CUT
    first = torch.cat([torch.tensor([True]), group[1:] != group[:-1]])
    return x[rows], mask[rows], labels[rows[~first]]


def worker(out: str) -> None:
    import torch.distributed as dist

    from mmembed.training.distributed import GlobalBatchLoss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for name, opts in CONFIGS:
        x, mask, labels = shard(rank)
        model = nn.parallel.DistributedDataParallel(TokenEncoder())
        outputs = model(x, mask)
        results.append({"width": outputs["last_hidden_state"].shape[1]})
        loss = GlobalBatchLoss(build_loss(name, **opts))(outputs, labels)
        loss.backward()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        results[-1].update(loss=reported.item() / dist.get_world_size(),
                           grads={k.removeprefix("module."): p.grad.detach().clone()
                                  for k, p in model.named_parameters()})
    widths = [None, None]
    dist.all_gather_object(widths, [r["width"] for r in results])
    if rank == 0:
        torch.save({"results": results, "widths": widths}, out)
    del model, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_processes_with_different_lengths_equal_one_process(tmp_path):
    import pytest
    from conftest import launch

    out = tmp_path / "grads.pt"
    launch([os.path.abspath(__file__), "--out", str(out)], nproc=2, timeout=600, torchrun=True)
    got = torch.load(out)
    assert got["widths"][0][0] < got["widths"][1][0]  # the two processes padded to different L
    for result, (name, opts) in zip(got["results"], CONFIGS, strict=True):
        ref_loss, ref_grads = reference_grads(name, opts)
        assert result["loss"] == pytest.approx(ref_loss, abs=1e-9), (name, opts)
        for k, g in ref_grads.items():
            torch.testing.assert_close(result["grads"][k], g, atol=1e-9, rtol=1e-7, msg=f"{name} {opts} {k}")
        assert any(g.abs().max() > 1e-3 for g in ref_grads.values())


def test_gradcache_with_different_lengths_per_chunk_equals_the_plain_step():
    """Chunks of the cache pad to their own longest row; the cached step pads them to the
    widest and slices each chunk's gradient back: the gradients equal the plain step's."""
    from mmembed.training.gradcache import GradCache

    x, mask, labels, _ = global_batch()
    for name, opts in CONFIGS:
        loss_fn = build_loss(name, **opts)
        plain = TokenEncoder()
        plain_loss = loss_fn(plain(x, mask), labels)
        plain_loss.backward()
        for size in (3, 5):
            cached = TokenEncoder()
            widths = [int(mask[i : i + size].sum(1).max()) for i in range(0, x.shape[0], size)]
            assert len(set(widths)) > 1
            loss = GradCache(cached, loss_fn, size).step({"input_ids": x, "attention_mask": mask}, labels)
            assert abs(float(loss) - float(plain_loss.detach())) < 1e-12
            for (k, p), q in zip(plain.named_parameters(), cached.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, atol=1e-12, rtol=1e-10, msg=f"{name} {opts} {k} {size}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    worker(sys.argv[sys.argv.index("--out") + 1])
