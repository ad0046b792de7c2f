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

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses.base import GUIDE, TEACHER, TEACHER_SCORES, CrossProcess, Groups, as_groups
from ..losses.parts import GroupParts, RowParts, SideRows


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


def max_over_processes(n: int, device: torch.device) -> int:
    """The largest ``n`` of all processes (this one's alone without a process group of several)."""
    return max(gather_sizes(n, device)) if world()[1] > 1 else n


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

    The loss says how (its :attr:`~mmembed.losses.EmbeddingLoss.cross_process`):

    - ``GROUP_PARTS`` (``infonce``, ``gist``, ``distill_kl`` with ``use_batch``): each field
      of the local :class:`~mmembed.losses.GroupParts` (after ``hard_negatives`` selection)
      is gathered, the student's with gradient, a guide's or teacher's rows without; each
      process computes the mean loss of its own anchors against the global batch
      (``forward_from_parts``) and reports it scaled by ``B_r * W / B``.
    - ``ROW_PARTS`` (``distill_marginal``): the same over rows (:class:`~mmembed.losses.RowParts`).
    - ``LOCAL_GROUPS`` / ``LOCAL_PAIRS`` / ``LOCAL_ROWS``: nothing crosses processes; the
      local mean is scaled by its share of the groups, pairs or rows.
    - ``WHOLE_BATCH`` (``online_contrastive``, and any loss that declares nothing): every
      process computes the loss on the gathered global batch (the gather's backward sums
      the W identical gradients, the average divides them again).

    The labels are turned into what the loss takes (:meth:`~mmembed.losses.EmbeddingLoss.targets`:
    groups split once) here, once per batch. With one process the loss is called on them
    unchanged.
    """

    def __init__(self, loss: nn.Module):
        super().__init__()
        self.loss = loss

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Tensor:
        rank, w = world()
        strategy = getattr(self.loss, "cross_process", CrossProcess.WHOLE_BATCH)
        if w > 1 and strategy is CrossProcess.WHOLE_BATCH:
            outputs, labels = _gather_batch(outputs, labels)
        targets = self._targets(outputs, labels)
        if w == 1 or strategy is CrossProcess.WHOLE_BATCH:
            return self.loss(outputs, targets)
        return _STRATEGIES[strategy](self.loss, outputs, targets, rank, w)

    def _targets(self, outputs: Mapping[str, Tensor], labels: Tensor):
        to_targets = getattr(self.loss, "targets", None)
        if to_targets is None:
            return labels
        emb = outputs["last_hidden_state"]
        return to_targets(labels.to(emb.device), emb.shape[0])


def _scaled_local(units):
    """The local mean scaled by this process's share of the ``units(outputs, targets)``."""

    def run(loss, outputs, targets, rank: int, w: int) -> Tensor:
        emb = outputs["last_hidden_state"]
        sizes = gather_sizes(units(outputs, targets), emb.device)
        return loss(outputs, targets) * (sizes[rank] * w / sum(sizes))

    return run


def _group_parts(loss, outputs, groups: Groups, rank: int, w: int) -> Tensor:
    """Each process scores its own anchors against the documents of all processes."""
    parts: GroupParts = loss.split_parts(outputs, groups)
    # one exchange of the per-process sizes: groups and negatives (and, for token vectors
    # [*, L, D], the lengths L, which differ between processes)
    tokens = [x.shape[1] if x.dim() == 3 else 0 for x in (parts.anchors, parts.positives, parts.negatives)]
    local = torch.tensor([parts.n_queries, parts.negatives.shape[0], *tokens], dtype=torch.long,
                         device=parts.anchors.device)
    table = [torch.zeros_like(local) for _ in range(w)]
    dist.all_gather(table, local)
    counts = [int(t[0]) for t in table]
    negs = [int(t[1]) for t in table]
    offset = sum(counts[:rank])
    if any(tokens):  # pad L with zero (absent) tokens to the longest: no MaxSim score changes
        width = int(torch.stack(table)[:, 2:].max())
        parts = parts.with_student(lambda x: F.pad(x, (0, 0, 0, width - x.shape[1])))
    gathered = GroupParts(
        anchors=all_gather_with_grad(parts.anchors, counts),
        positives=all_gather_with_grad(parts.positives, counts),
        negatives=all_gather_with_grad(parts.negatives, negs),
        neg_group=_gather_padded(parts.neg_group + offset, negs),
        # a guide's or teacher's rows of the same groups (gist, distill_kl): no gradient
        **{name: SideRows(_gather_padded(side.anchors.detach(), counts),
                          _gather_padded(side.positives.detach(), counts),
                          _gather_padded(side.negatives.detach(), negs))
           for name, side in parts.sides().items()},
    )
    result = loss.forward_from_parts(gathered, query_rows=slice(offset, offset + counts[rank]))
    return result * (counts[rank] * w / sum(counts))


def _row_parts(loss, outputs, targets, rank: int, w: int) -> Tensor:
    """Each process's rows against the (side) rows of all processes."""
    parts: RowParts = loss.split_parts(outputs, targets)
    sizes = gather_sizes(parts.n_queries, parts.student.device)
    offset = sum(sizes[:rank])
    gathered = RowParts(student=all_gather_with_grad(parts.student, sizes),
                        **{name: _gather_padded(side.detach(), sizes) for name, side in parts.sides().items()})
    result = loss.forward_from_parts(gathered, query_rows=slice(offset, offset + sizes[rank]))
    return result * (sizes[rank] * w / sum(sizes))


def _gather_batch(outputs: Mapping[str, Tensor], labels: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """The whole global batch on every process: the embeddings with gradient, the side
    inputs and labels without. Each process holds whole groups (or pairs), so the
    concatenation in rank order is a valid batch of the same layout; per-group side
    inputs (``teacher_scores``) are padded with NaN to the widest."""
    emb = outputs["last_hidden_state"]
    sizes = gather_sizes(emb.shape[0], emb.device)
    if emb.dim() == 3:  # token vectors: pad L with zero (absent) tokens to the longest process's
        emb = F.pad(emb, (0, 0, 0, max_over_processes(emb.shape[1], emb.device) - emb.shape[1]))
    gathered = {"last_hidden_state": all_gather_with_grad(emb, sizes)}
    for key, value in outputs.items():
        if key == "last_hidden_state" or value is None:
            continue
        if key == TEACHER_SCORES:
            width = torch.tensor([value.shape[1]], device=value.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            padded = value.new_full((value.shape[0], int(width)), float("nan"))
            padded[:, : value.shape[1]] = value
            value = all_gather_no_grad(padded)
        elif key in (GUIDE, TEACHER):  # per row: a guide's / teacher's embeddings
            value = _gather_padded(value.detach(), sizes)
        else:
            raise ValueError(f"cannot gather outputs[{key!r}] across processes (known: {GUIDE}, {TEACHER}, "
                             f"{TEACHER_SCORES})")
        gathered[key] = value
    return gathered, all_gather_no_grad(labels)


_STRATEGIES = {
    CrossProcess.GROUP_PARTS: _group_parts,
    CrossProcess.ROW_PARTS: _row_parts,
    CrossProcess.LOCAL_GROUPS: _scaled_local(lambda outputs, groups: as_groups(
        groups, outputs["last_hidden_state"].shape[0]).n_groups),
    CrossProcess.LOCAL_PAIRS: _scaled_local(lambda outputs, scores: scores.shape[0]),
    CrossProcess.LOCAL_ROWS: _scaled_local(lambda outputs, labels: outputs["last_hidden_state"].shape[0]),
}
