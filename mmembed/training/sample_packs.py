"""``--packing true``: batches of a token budget, as ms-swift 4.6 packs embedding and reranker rows.

ms-swift's ``--packing`` groups whole training rows (a row: its anchor, positives and negatives,
or a reranker's query with its documents) into *packs* of at most ``--packing_length`` tokens
(default ``--max_length``), counting every input of the row; a step's micro-batch is then
``--per_device_train_batch_size`` packs, so a step takes as many rows as fit the budget instead
of a fixed count (short rows: many per step; long ones: few). It also packs each batch into
one sequence (``--padding_free``), which mmembed does in the model where the attention keeps the
rows apart without a dense mask (:mod:`mmembed.model.packing`; ``--attn_impl flash_attn`` or
``varlen``).

The packs are ms-swift's, computed the same way from the same lengths
(:func:`pack_indices`): the rows' lengths a thousand at a time, each group bin-packed by the
``binpacking`` library (``--packing_strategy binpack``: best fit of the longest first) or
cut in order (``sequential``: a new pack when the next row would overflow), the last open pack
of a group carried into the next; with ``--packing_num_proc N`` the lengths are split into N
contiguous shares packed apart, their packs in share order. Training then draws the packs in
ms-swift's order (:class:`~mmembed.training.samplers.SwiftOrderSampler` over pack indices),
and the collator takes a batch of packs as the rows they hold, in pack order, so the loss of a
step is the loss of those rows unpacked.

A row's length is the sum of its inputs' tokens as the model sees them (media expanded,
``--check_media`` as for the length check), each input counted to at most ``--max_length``
where rows are truncated (:func:`row_token_totals`); the result is cached with the dataset.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ..errors import UsageError
from .flag_checks import PACKING_STRATEGIES

logger = logging.getLogger("mmembed")

#: rows packed per group (ms-swift's PackingDataset.PACKING_BATCH_SIZE)
PACK_GROUP = 1000


def pack_indices(lengths: list[int], packing_length: int, strategy: str = "binpack", num_proc: int = 1) -> list[list[int]]:
    """The packs (lists of row indices) of rows with ``lengths`` tokens, as ms-swift 4.6 makes them."""
    if strategy not in PACKING_STRATEGIES:
        raise UsageError(f"--packing_strategy must be one of {', '.join(PACKING_STRATEGIES)}, got {strategy!r}")
    shares = max(1, min(num_proc, math.ceil(len(lengths) / PACK_GROUP)))
    bounds = np.linspace(0, len(lengths), shares + 1, dtype=np.int64)
    packs: list[list[int]] = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        items = [(i, int(lengths[i])) for i in range(a, b)]
        carry: list[tuple[int, int]] = []
        for start in range(0, len(items), PACK_GROUP):
            carry = carry + items[start:start + PACK_GROUP]
            finished = start + PACK_GROUP >= len(items)
            groups, carry = _matched(carry, packing_length, finished, strategy)
            packs += [[i for i, _ in g] for g in groups]
    return packs


def _matched(items: list[tuple[int, int]], packing_length: int, finished: bool, strategy: str):
    """One group's packs, and the rows carried into the next group (an open pack)."""
    if not items:
        return [], []
    if strategy == "sequential":  # next fit in the rows' order
        packs, current, used = [], [], 0
        for item in items:
            if current and used + item[1] > packing_length:
                packs.append(current)
                current, used = [], 0
            current.append(item)
            used += item[1]
            if used >= packing_length:
                packs.append(current)
                current, used = [], 0
        if finished:
            return packs + ([current] if current else []), []
        return packs, current
    import binpacking

    bins = binpacking.to_constant_volume(items, packing_length, weight_pos=1)
    if bins and not finished:
        return bins[:-1], list(bins[-1])
    return bins, []


class PackedRows(torch.utils.data.Dataset):
    """The training rows grouped into packs: item ``i`` is the list of pack ``i``'s rows (the
    collators take a batch of packs as the rows they hold)."""

    def __init__(self, rows, packs: list[list[int]], lengths: list[int]):
        self.rows, self.packs = rows, packs
        self.pack_tokens = [sum(lengths[i] for i in p) for p in packs]

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> list:
        return [self.rows[i] for i in self.packs[int(index)]]


def pack_training_rows(args, encoding, media, layout, task, rows):
    """``rows`` (the training rows) grouped into ``--packing_length`` packs: a :class:`PackedRows`."""
    from .length_check import row_token_totals

    budget = args.packing_length or encoding.max_length
    lengths = row_token_totals(args, encoding, media, layout, task, rows)
    packs = pack_indices(lengths, budget, args.packing_strategy, args.packing_num_proc)
    over = sum(1 for p in packs if len(p) == 1 and lengths[p[0]] > budget)
    packed = PackedRows(rows, packs, lengths)
    logger.info("--packing: %d training rows in %d packs of at most %d tokens (%s; %.1f rows, %.0f tokens a pack on "
                "average%s)", len(lengths), len(packs), budget, args.packing_strategy, len(lengths) / max(1, len(packs)),
                float(np.mean(packed.pack_tokens)) if packs else 0.0,
                f"; {over} row(s) longer than the budget, each a pack of its own" if over else "")
    return packed
