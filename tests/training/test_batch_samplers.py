"""One dataset's global batches (mmembed/training/batch_samplers.py): the plain and the
duplicate-free batch samplers the multi-dataset samplers draw from. The references are written
out here: pass ``p`` is the dataset's rows permuted with ``numpy.random.default_rng([seed,
index, p])``, cut into whole batches."""

from __future__ import annotations

import numpy as np
import pytest

from mmembed.training.batch_samplers import (
    BatchSamplerKind,
    DatasetBatches,
    NoDuplicatesBatches,
    PlainBatches,
    dataset_batches,
    dataset_parts,
    duplicate_free_batches,
)

ROWS = np.arange(100, 111)  # 11 rows of a training set: 3 batches of 3 per pass, 2 rows sit out


def _permuted(rows, seed, index, p):
    return rows[np.random.default_rng([seed, index, p]).permutation(len(rows))]


def test_plain_batches_are_each_pass_permutation_cut_in_whole_batches():
    b = PlainBatches(ROWS, 3, seed=5, index=2)
    for position in range(10):
        p, j = divmod(position, 3)
        order = _permuted(ROWS, 5, 2, p).tolist()
        assert b.locate(position) == (p, j)
        assert b.batch(position) == order[j * 3:(j + 1) * 3]
    assert [b.batches_per_pass(p) for p in range(4)] == [3] * 4
    assert b.batch(0) != b.batch(3)  # a new permutation each pass
    assert b.batch(0) != PlainBatches(ROWS, 3, seed=5, index=1).batch(0)  # and each dataset


def test_plain_batches_unshuffled_keep_the_rows_order_every_pass():
    b = PlainBatches(ROWS, 3, seed=5, index=0, shuffle=False)
    assert [b.batch(k) for k in range(4)] == [[100, 101, 102], [103, 104, 105], [106, 107, 108], [100, 101, 102]]


def test_a_pass_that_fills_no_batch_is_an_error():
    """(The samplers refuse a dataset smaller than one global batch before they build its batches.)"""
    for b in (PlainBatches(ROWS[:2], 3, seed=0, index=0), NoDuplicatesBatches(np.arange(3), 2, 0, 0, keys=KEYS[:3])):
        with pytest.raises(ValueError, match="cannot fill one batch"):
            b.pass_batches(0)


# keys of rows 0-5 (texts as numbers): rows 0, 1, 2 share text 1
KEYS = [frozenset({1}), frozenset({1, 7}), frozenset({1}), frozenset({2}), frozenset({3}), frozenset({4})]


def test_no_duplicates_batches_let_a_repeating_row_wait_and_count_each_pass():
    """Unshuffled, batches of 2 from rows 0-5: [0, 3] (1 and 2 wait), [1, 4] (2 waits again),
    [2, 5]; with rows 0-3 only [0, 3] fills (1 and 2 share a text): one batch per pass, not 2."""
    b = NoDuplicatesBatches(np.arange(6), 2, seed=0, index=0, shuffle=False, keys=KEYS)
    assert [b.batch(k) for k in range(4)] == [[0, 3], [1, 4], [2, 5], [0, 3]]
    short = NoDuplicatesBatches(np.arange(4), 2, seed=0, index=0, shuffle=False, keys=KEYS)
    assert short.batches_per_pass(0) == 1 and short.locate(3) == (3, 0)
    assert [short.batch(k) for k in range(2)] == [[0, 3], [0, 3]]


def test_no_duplicates_positions_run_through_passes_of_their_own_length():
    """Shuffled: the batches at positions 0, 1, ... are pass 0's, then pass 1's, ... each pass
    its rows permuted with (seed, index, p) and cut without a text twice in a batch."""
    rng = np.random.default_rng(3)
    keys = [frozenset(int(x) for x in rng.choice(12, size=2, replace=False)) for _ in range(30)]
    b = NoDuplicatesBatches(np.arange(30), 4, seed=9, index=1, keys=keys)
    expected = []
    for p in range(4):  # each pass: duplicate_free_batches (its own test is in test_multi_samplers.py)
        batches = duplicate_free_batches(_permuted(np.arange(30), 9, 1, p), keys, 4)
        assert b.batches_per_pass(p) == len(batches) > 0
        expected += batches
    assert b.locate(b.batches_per_pass(0) + b.batches_per_pass(1)) == (2, 0)
    assert [b.batch(k) for k in range(len(expected))] == expected
    assert all(not (keys[i] & keys[j]) for batch in expected for i in batch for j in batch if i != j)


def test_the_batch_sampler_kind_picks_the_class():
    assert [k.value for k in BatchSamplerKind] == ["default", "no_duplicates"]
    assert str(BatchSamplerKind.NO_DUPLICATES) == f"{BatchSamplerKind.NO_DUPLICATES}" == "no_duplicates"
    plain, free = dataset_batches(ROWS, 3, 0, 0), dataset_batches(np.arange(6), 2, 0, 0, keys=KEYS)
    assert type(plain) is PlainBatches and type(free) is NoDuplicatesBatches
    assert isinstance(plain, DatasetBatches) and isinstance(free, DatasetBatches)
    assert (plain.no_duplicates, free.no_duplicates) == (False, True)


def test_dataset_parts_read_the_ids_names_and_weights():
    class Sized:
        dataset_ids = np.array([1, 0, 1, 1])

        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise AssertionError("a row was read")

    parts = dataset_parts(Sized(), [type("I", (), {"name": "x", "weight": 2.0})()])
    assert [(p.name, p.weight, p.rows.tolist()) for p in parts] == [("x", 2.0, [1]), ("dataset 1", 1.0, [0, 2, 3])]
    assert [(p.name, p.rows.tolist()) for p in dataset_parts(list(range(3)))] == [("all rows", [0, 1, 2])]
