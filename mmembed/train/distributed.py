"""Several processes, one global batch: gathers that carry gradient, and losses scaled so
that averaged gradients equal one process's gradient on the whole global batch.

Who is a negative of whom: with ``INFONCE_USE_BATCH=true`` each process scores its own
anchors against the documents (positives and hard negatives) of *every* process. The
gathered documents keep their graph: the gradient a process computes for another process's
documents is sent back to it (an all-reduce of the gathered gradient, each process keeping
its own rows), so every document is pushed by every anchor that saw it.

Gradient scaling: data-parallel training averages parameter gradients over the W
processes. If process r has B_r of the B = sum_r B_r anchors of the global batch and
reports ``(W / B) * sum_{i in r} l_i``, the average over processes is
``(1 / B) * sum_i l_i``, the global-batch loss, and so are its gradients. Process sizes may
differ (the last batch of an epoch, variable negative counts): sizes are exchanged first,
and tensors are padded to the largest, gathered, and unpadded; nothing is pickled.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when no process group is running."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_sizes(n: int, device: torch.device) -> list[int]:
    """Every process's ``n``, in rank order."""
    _, w = world()
    local = torch.tensor([n], dtype=torch.long, device=device)
    out = [torch.zeros_like(local) for _ in range(w)]
    dist.all_gather(out, local)
    return [int(x.item()) for x in out]


def _gather_padded(x: Tensor, sizes: list[int]) -> Tensor:
    """Concatenate every process's ``x`` (rows ``sizes[r]``) in rank order, without graph."""
    width = max(sizes)
    if width == 0:
        return x.new_zeros((0, *x.shape[1:]))
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded.contiguous())
    return torch.cat([t[:n] for t, n in zip(out, sizes)])


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: all processes' rows concatenated. Backward: every process's gradient for
    the gathered rows is summed (all-reduce) and each keeps the part for its own rows."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], rank: int) -> Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        return _gather_padded(x, sizes)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def all_gather_with_grad(x: Tensor, sizes: list[int] | None = None) -> Tensor:
    """``[sum_r n_r, ...]``: the rows of every process in rank order; gradients flow back to
    the process that owns each row. ``sizes`` (every process's row count) is exchanged when
    not given. With one process, ``x`` itself."""
    rank, w = world()
    if w == 1:
        return x
    sizes = sizes if sizes is not None else gather_sizes(x.shape[0], x.device)
    return _AllGatherWithGrad.apply(x, sizes, rank)


def all_gather_no_grad(x: Tensor) -> Tensor:
    """Every process's rows of ``x`` (any sizes), concatenated in rank order, without graph."""
    _, w = world()
    if w == 1:
        return x
    return _gather_padded(x.detach(), gather_sizes(x.shape[0], x.device))


class GlobalBatchLoss(nn.Module):
    """Wrap a loss so that, over W processes, averaged gradients equal the global-batch gradient.

    - ``infonce``: local parts (after ``hard_negatives`` selection) are gathered with
      gradient; each process computes the mean loss of its own anchors against the global
      batch (``forward_from_parts``) and reports it scaled by ``B_r * W / B``. With
      ``use_batch=false`` nothing crosses processes, only the scaling applies.
    - mean pair losses (``cosine_similarity``, ``contrastive``): pairs do not interact, so
      the local mean is scaled by ``P_r * W / P``.
    - ``online_contrastive`` picks its hard pairs from statistics of the whole batch: every
      process computes it on the gathered global batch (the gather's backward sums the W
      identical gradients, the average divides them again).

    With one process the wrapped loss is called unchanged.
    """

    def __init__(self, loss: nn.Module, loss_type: str):
        super().__init__()
        self.loss = loss
        self.loss_type = loss_type

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Tensor:
        rank, w = world()
        if w == 1:
            return self.loss(outputs, labels)
        emb = outputs["last_hidden_state"]
        if self.loss_type in ("infonce", "gist", "distill_kl"):
            return self._groups(outputs, labels, rank, w)
        if self.loss_type == "distill_marginal":
            student, teacher = self.loss.split_parts(outputs, labels)
            sizes = gather_sizes(student.shape[0], emb.device)
            offset = sum(sizes[:rank])
            loss = self.loss.forward_from_parts(all_gather_with_grad(student, sizes), _gather_padded(teacher.detach(), sizes),
                                                query_rows=slice(offset, offset + sizes[rank]))
            return loss * (sizes[rank] * w / sum(sizes))
        if self.loss_type in ("distill_cosine", "distill_mse"):  # per-row means: rows do not interact
            sizes = gather_sizes(emb.shape[0], emb.device)
            return self.loss(outputs, labels) * (sizes[rank] * w / sum(sizes))
        if self.loss_type == "online_contrastive":
            sizes = gather_sizes(emb.shape[0], emb.device)
            glob = all_gather_with_grad(emb, sizes)
            return self.loss({"last_hidden_state": glob}, all_gather_no_grad(labels))
        n_local = labels.shape[0]
        n_total = sum(gather_sizes(n_local, emb.device))
        return self.loss(outputs, labels) * (n_local * w / n_total)

    def _groups(self, outputs, labels, rank: int, w: int) -> Tensor:
        """Group losses (infonce, gist, distill_kl, and matryoshka around them): each process
        scores its own anchors against the documents of all processes."""
        emb = outputs["last_hidden_state"]
        n_groups = emb.shape[0] - labels.shape[0]  # one label per positive and per negative
        if not uses_whole_batch(self.loss):  # nothing crosses processes (distill_kl may take per-group teacher_scores)
            groups = gather_sizes(n_groups, emb.device)
            return self.loss(outputs, labels) * (groups[rank] * w / sum(groups))
        parts = self.loss.split_parts(outputs, labels)
        anchors, positives, negatives, neg_group = parts[:4]
        # one exchange of the per-process sizes: groups and negatives
        local = torch.tensor([anchors.shape[0], negatives.shape[0]], dtype=torch.long, device=anchors.device)
        table = [torch.zeros_like(local) for _ in range(w)]
        dist.all_gather(table, local)
        groups = [int(t[0]) for t in table]
        negs = [int(t[1]) for t in table]
        total = sum(groups)
        offset = sum(groups[:rank])
        g_anchors = all_gather_with_grad(anchors, groups)
        g_positives = all_gather_with_grad(positives, groups)
        g_negatives = all_gather_with_grad(negatives, negs)
        g_neg_group = _gather_padded(neg_group + offset, negs)
        # a guide's or teacher's embeddings of the same parts (gist, distill_kl): no gradient
        side = [_gather_padded(t.detach(), n) for t, n in zip(parts[4:], (groups, groups, negs))]
        loss = self.loss.forward_from_parts(
            g_anchors, g_positives, g_negatives, g_neg_group, *side, query_rows=slice(offset, offset + groups[rank])
        )
        return loss * (groups[rank] * w / total)


def uses_whole_batch(loss: nn.Module) -> bool:
    """Whether a group loss scores against the whole batch (gist always does)."""
    config = getattr(loss, "config", None)
    if config is not None and hasattr(config, "use_batch"):
        return bool(config.use_batch)
    return bool(getattr(loss, "use_batch", True))
