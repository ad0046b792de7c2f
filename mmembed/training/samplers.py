"""The order in which training rows reach each process.

A sampler here is a small class over the dataset's row indices (``0 .. len - 1``) that
yields the rows of one process for one epoch; the trainer asks :func:`train_sampler` for
it and falls back to transformers' own samplers where it returns None.

- :class:`SwiftOrderSampler`: ms-swift's order, so that the same flags and data train on
  the same rows in the same steps as ``swift sft`` (tests/tools/test_swift_compat.py holds
  it against ms-swift's recorded orders, one and two processes).
- :func:`pass_through_shards`: such a sampler has split each epoch among the processes
  already, so accelerate's batch-level sharding of the data loader must hand every batch
  through unchanged.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from .distributed import world


class SwiftOrderSampler(Sampler):
    """The training rows of one process in ms-swift's order (its ``BatchSamplerShard``): each
    epoch a permutation of the rows drawn with ``seed + epoch`` (``torch.randperm``; in file order
    without shuffling), cut to a multiple of the process count (the last ``len % world`` rows
    sit the epoch out), of which process ``rank`` takes every ``world``-th from its ``rank``.
    With one process this is transformers' seeded random sampler, row for row."""

    def __init__(self, num_rows: int, shuffle: bool, seed: int, rank: int = 0, world: int = 1):
        self.num_rows, self.shuffle, self.seed, self.rank, self.world = num_rows, shuffle, seed, rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_rows // self.world

    def __iter__(self):
        total = self.num_rows // self.world * self.world
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(total, generator=generator).tolist()
        else:
            order = list(range(total))
        return iter(order[self.rank::self.world])


def train_sampler(dataset, args) -> Sampler | None:
    """The sampler of ``dataset``'s training rows for this process under the training
    arguments ``args`` (``train_sampling_strategy``, ``train_dataloader_shuffle``,
    ``data_seed`` / ``seed``): ms-swift's order for ``random`` and ``sequential``; None for a
    dataset without a length (a stream) and for transformers' length-grouped strategies,
    which the Trainer's own sampler serves."""
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    if dataset is None or not hasattr(dataset, "__len__") or strategy not in ("random", "sequential"):
        return None
    shuffle = strategy == "random" and getattr(args, "train_dataloader_shuffle", True)
    seed = args.data_seed if args.data_seed is not None else args.seed
    rank, size = world()
    return SwiftOrderSampler(len(dataset), shuffle, seed, rank, size)


def pass_through_shards(loader: DataLoader) -> DataLoader:
    """``loader`` (the Trainer's, as accelerate prepared it) with its batch-level sharding over
    the processes turned off where the sampler inside gives this process its own rows already
    (ms-swift's split of each epoch's order), so no process drops the others' batches."""
    shard = getattr(loader, "batch_sampler", None)
    if world()[1] > 1 and shard is not None and hasattr(shard, "num_processes"):
        inner = getattr(getattr(shard, "batch_sampler", None), "sampler", None)
        if isinstance(inner, SwiftOrderSampler):
            shard.num_processes, shard.process_index = 1, 0
    return loader
