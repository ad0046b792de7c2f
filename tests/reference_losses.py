"""Plain per-group reference of InfoNCE, written as the semantics read.

Deliberately naive: the layout is walked row by row in Python, each anchor's logits are
built as a list of scalar dot products in ms-swift's interleaved document order
(p0, n0_*, p1, n1_*, ...), and each cross-entropy is ``-log_softmax(logits)[target]``.
It shares no code with ``mmembed.losses`` so the two can check each other. Used by the
tests and by ``benchmarks/bench_infonce.py``.
"""

from __future__ import annotations

import torch


def parse_groups(n_rows: int, labels: list[float]) -> list[tuple[int, int, list[int]]]:
    """Walk ``a, p, n, ..., a, p, ...``: return ``(anchor_row, positive_row, negative_rows)`` per group."""
    groups = []
    row = 0
    k = 0
    while k < len(labels):
        assert labels[k] == 1.0, f"label {k} should start a group"
        anchor, positive = row, row + 1
        row += 2
        k += 1
        negatives = []
        while k < len(labels) and labels[k] == 0.0:
            negatives.append(row)
            row += 1
            k += 1
        groups.append((anchor, positive, negatives))
    assert row == n_rows
    return groups


def reference_rows(
    emb: torch.Tensor,
    labels,
    *,
    use_batch: bool = True,
    picks: list[list[int]] | None = None,
    mask_fake_negative: bool = False,
    fake_neg_margin: float = 0.1,
    include_qq: bool = False,
    include_dd: bool = False,
) -> list[tuple[torch.Tensor, int]]:
    """Each anchor's logits before the temperature (``-inf`` where masked) and the index of
    its positive among them, built one scalar at a time as the semantics read.

    ``picks[g]`` (when given) lists which of group g's negatives to use, by position
    within the group: this is how ``hard_negatives`` truncation / padding is fed in.
    """
    labels = [float(x) for x in labels]
    groups = parse_groups(emb.shape[0], labels)
    if picks is not None:
        groups = [(a, p, [negs[j] for j in picks[g]]) for g, (a, p, negs) in enumerate(groups)]

    def s(i: int, j: int) -> torch.Tensor:
        return torch.dot(emb[i], emb[j])

    minus_inf = torch.tensor(float("-inf"), dtype=emb.dtype)
    rows = []
    if not use_batch:
        for a, p, negs in groups:
            rows.append((torch.stack([s(a, p)] + [s(a, n) for n in negs]), 0))
        return rows

    docs = []  # rows of every document, in group order
    pos_col = []  # column of each group's positive among docs
    for _, p, negs in groups:
        pos_col.append(len(docs))
        docs.append(p)
        docs.extend(negs)

    for i, (a, p, _) in enumerate(groups):
        positive_score = s(a, p)
        row = []
        for c, d in enumerate(docs):
            value = s(a, d)
            if mask_fake_negative and c != pos_col[i] and value > positive_score + fake_neg_margin:
                value = minus_inf
            row.append(value)
        if include_qq:
            for j, (other, _, _) in enumerate(groups):
                if j == i:
                    continue
                value = s(a, other)
                if mask_fake_negative and value > positive_score + fake_neg_margin:
                    value = minus_inf
                row.append(value)
        if include_dd:
            for c, d in enumerate(docs):
                if c != pos_col[i]:
                    row.append(s(p, d))
        rows.append((torch.stack(row), pos_col[i]))
    return rows


def reference_infonce(emb: torch.Tensor, labels, *, temperature: float = 0.1, **options) -> torch.Tensor:
    """InfoNCE of ``emb [N, D]`` with ms-swift's ``labels``, one anchor at a time (the
    options of :func:`reference_rows`)."""
    losses = [-torch.log_softmax(row / temperature, 0)[target] for row, target in reference_rows(emb, labels, **options)]
    return torch.stack(losses).mean()


def reference_maxsim(q, d, normalize: bool = False) -> float:
    """MaxSim written out: the sum over ``q``'s nonzero token vectors of the best dot product
    with ``d``'s nonzero ones (a document without any scores 0), divided by the query's number
    of nonzero tokens with ``normalize``."""
    total, n_q = 0.0, 0
    for qi in q:
        if not bool(qi.ne(0).any()):
            continue
        n_q += 1
        dots = [float(qi @ dj) for dj in d if bool(dj.ne(0).any())]
        total += max(dots) if dots else 0.0
    return total / max(n_q, 1) if normalize else total
