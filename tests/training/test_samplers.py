"""The training rows of each process, in ms-swift's order (mmembed/training/samplers.py).

The reference orders are ms-swift's own, recorded by tests/fixtures/swift/make_fixtures.py
(`swift sft` on the files of tests/fixtures/swift/data, one and two processes). Where ms-swift
kept the files' order (``--dataset_shuffle false``), the dataset is the files' rows in order,
so the sampler alone must give the recorded rows. The runs where ms-swift also shuffled the
dataset, split it or sampled ``file#N`` go through the whole trainer in
tests/tools/test_swift_compat.py.
"""

import json
import os

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from conftest import REPO
from torch.utils.data import BatchSampler, DataLoader

import mmembed.training.samplers as samplers
from mmembed.training.samplers import SwiftOrderSampler, pass_through_shards, train_sampler

FIXTURES = os.path.join(REPO, "tests", "fixtures", "swift")


def _recorded(name: str) -> dict:
    return json.load(open(os.path.join(FIXTURES, name)))


def _row_ids(*files: str) -> list[int]:
    """The ``id N`` of each row of the files, in file order (the dataset ms-swift read unshuffled)."""
    ids = []
    for name in files:
        with open(os.path.join(FIXTURES, "data", name), encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["messages"][0]["content"]
                ids.append(int(text.split(":", 1)[0].removeprefix("id ")))
    return ids


def _steps(sampler, ids: list[int], epochs: int, batch: int = 2) -> list[list[int]]:
    steps = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        rows = [ids[i] for i in sampler]
        steps += [rows[i:i + batch] for i in range(0, len(rows), batch)]
    return steps


def test_one_process_shuffled_is_ms_swifts_order():
    """--dataset_shuffle false (the file's order), the sampler shuffling with the default seed
    42, two epochs of batches of 2: each epoch a fresh permutation drawn with seed + epoch."""
    run = _recorded("orders.json")["no_shuffle"]
    ids = _row_ids("text.jsonl")
    assert _steps(SwiftOrderSampler(len(ids), shuffle=True, seed=42), ids, epochs=2) == run["steps"]


def test_two_processes_unshuffled_take_every_second_row_from_their_rank():
    """Two processes, neither the dataset nor the sampler shuffled: of the 17 rows, process r
    takes rows r, r + 2, ... of the first 16; the 17th sits the epoch out."""
    run = _recorded("orders_2proc.json")["two_processes_no_shuffle"]
    ids = _row_ids("text.jsonl", "more.jsonl")
    assert len(ids) == 17
    for rank, recorded in enumerate(run["steps_per_process"]):
        sampler = SwiftOrderSampler(len(ids), shuffle=False, seed=42, rank=rank, world=2)
        assert _steps(sampler, ids, epochs=1) == recorded, f"process {rank}"


@pytest.mark.parametrize("num_rows, world", [(17, 2), (10, 3), (8, 4), (5, 1)])
def test_processes_split_one_permutation_cut_to_a_multiple_of_their_count(num_rows, world):
    """The reference, written out: the epoch's permutation of the first ``num_rows // world *
    world`` rows (``torch.randperm`` seeded with seed + epoch), process r taking every
    world-th entry from r. So the processes never share a row, and together they take every
    row but the last ``num_rows % world``."""
    seed = 7
    for epoch in range(3):
        total = num_rows // world * world
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        shares = []
        for rank in range(world):
            sampler = SwiftOrderSampler(num_rows, shuffle=True, seed=seed, rank=rank, world=world)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
            assert shares[-1] == order[rank::world]
            assert len(sampler) == len(shares[-1]) == num_rows // world
        assert sorted(i for share in shares for i in share) == list(range(total))


class _Args:
    """The training arguments train_sampler reads (transformers' defaults)."""

    def __init__(self, **fields):
        self.train_sampling_strategy, self.train_dataloader_shuffle = "random", True
        self.seed, self.data_seed = 42, None
        self.__dict__.update(fields)


def test_train_sampler_reads_the_strategy_shuffle_and_seed(monkeypatch):
    monkeypatch.setattr(samplers, "world", lambda: (1, 2))
    rows = list(range(9))
    s = train_sampler(rows, _Args())
    assert isinstance(s, SwiftOrderSampler)
    assert (s.num_rows, s.shuffle, s.seed, s.rank, s.world) == (9, True, 42, 1, 2)
    assert train_sampler(rows, _Args(data_seed=3)).seed == 3  # --data_seed before --seed
    assert not train_sampler(rows, _Args(train_dataloader_shuffle=False)).shuffle
    assert not train_sampler(rows, _Args(train_sampling_strategy="sequential")).shuffle


def test_train_sampler_leaves_streams_and_length_grouping_to_transformers():
    stream = iter(range(4))  # no length
    assert train_sampler(stream, _Args()) is None
    assert train_sampler(None, _Args()) is None
    assert train_sampler(list(range(4)), _Args(train_sampling_strategy="group_by_length")) is None


def _sharded_loader(sampler, batch: int, rank: int) -> DataLoader:
    """A data loader whose batches accelerate shards over two processes, as it prepares the Trainer's."""
    shard = BatchSamplerShard(BatchSampler(sampler, batch, drop_last=False), num_processes=2, process_index=rank)
    return DataLoader(list(range(100)), batch_sampler=shard)


def test_accelerate_sharding_passes_the_samplers_own_share_through(monkeypatch):
    """Under two processes each SwiftOrderSampler gives its process its own rows already, so
    accelerate's sharding (process r keeping every second batch) must hand every batch through."""
    monkeypatch.setattr(samplers, "world", lambda: (1, 2))
    sampler = SwiftOrderSampler(12, shuffle=True, seed=42, rank=1, world=2)
    want = list(sampler)
    loader = pass_through_shards(_sharded_loader(sampler, 2, rank=1))
    assert [i for b in loader for i in b.tolist()] == want
    # another sampler is left to accelerate's sharding: process 1 keeps the second of each two batches
    loader = pass_through_shards(_sharded_loader(list(range(8)), 2, rank=1))
    assert [b.tolist() for b in loader] == [[2, 3], [6, 7]]


def test_one_process_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(samplers, "world", lambda: (0, 1))
    sampler = SwiftOrderSampler(8, shuffle=False, seed=0)
    loader = _sharded_loader(sampler, 2, rank=1)
    assert pass_through_shards(loader) is loader
    assert (loader.batch_sampler.num_processes, loader.batch_sampler.process_index) == (2, 1)


# ----------------------------------------------------------------------------- the pinned orders

def _pinned():
    import importlib.util

    path = os.path.join(REPO, "tests", "fixtures", "samplers", "make_orders.py")
    spec = importlib.util.spec_from_file_location("make_orders", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_configuration_gives_the_pinned_rows_positions_and_messages():
    """tests/fixtures/samplers/orders.json (tests/fixtures/samplers/make_orders.py): for every
    --multi_dataset_sampler x --batch_sampler, 1 or 2 processes (each rank), 1 or 2 accumulation
    steps, shuffled or not, and --interleave_prob: the start-up check, the log lines, the rows of
    epochs 0-2 and the recorded positions, or the error with its message, exactly as recorded."""
    make = _pinned()
    recorded = json.load(open(make.FIXTURE, encoding="utf-8"))
    now = make.record()
    assert sorted(now) == sorted(recorded)
    for name in recorded:
        assert now[name] == recorded[name], name
