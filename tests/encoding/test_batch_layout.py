"""The batch layout's one home (mmembed.encoding.layout): ms-swift's two layouts, spelled out,
and the splitters every other module reads them with.

Group layout: rows ``a0, p0, n0_*, a1, p1, n1_*, ...`` and one label per non-anchor row (1.0
for the positive, 0.0 for each negative). Pair layout: rows ``s1_0, s2_0, s1_1, s2_1, ...``
and one score per pair. The torch and the numpy splitter are one rule: they must agree on
every layout and fail with the same message on every malformed one.
"""

import ast
import os
import random
import warnings

import numpy as np
import pytest
import torch
from conftest import REPO

from mmembed.data.sample import Item, Sample
from mmembed.encoding.collator import EmbeddingCollator, item_origins, sample_items
from mmembed.encoding.layout import Layout, split_groups, split_groups_numpy, split_pair_rows
from mmembed.encoding.templates import get_template


def group_labels(neg_counts: list[int]) -> list[float]:
    """Labels for groups with these numbers of negatives: [1, 0 * k0, 1, 0 * k1, ...]."""
    return [x for k in neg_counts for x in [1.0] + [0.0] * k]


def reference_groups(neg_counts: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rows of each part, found by walking the rows one by one: (anchors, positives,
    negatives, group of each negative)."""
    anchors, positives, negatives, neg_group = [], [], [], []
    row = 0
    for g, k in enumerate(neg_counts):
        anchors.append(row)
        positives.append(row + 1)
        negatives += range(row + 2, row + 2 + k)
        neg_group += [g] * k
        row += 2 + k
    return anchors, positives, negatives, neg_group


def test_layout_values_are_ms_swifts_names():
    assert Layout("group") is Layout.GROUP and Layout("pair") is Layout.PAIR
    assert [m.value for m in Layout] == ["group", "pair", "rerank"]  # ms-swift's two, and a reranker's scored pairs
    assert Layout("rerank") is Layout.RERANK
    from mmembed.losses import Layout as public

    assert public is Layout  # the public name of mmembed.losses is this one


def test_split_groups_spelled_out():
    # a0 p0 n0_0 n0_1 | a1 p1 | a2 p2 n2_0
    labels = [1.0, 0, 0, 1, 1, 0]
    want = ([0, 4, 6], [1, 5, 7], [2, 3, 8], [0, 0, 2])
    assert [t.tolist() for t in split_groups(torch.tensor(labels), 9)] == list(want)
    got = split_groups_numpy(np.array(labels), 9)
    assert [a.tolist() for a in got] == list(want)
    assert all(a.dtype == np.int64 for a in got)


def random_layouts(seed: int = 0, n: int = 300):
    """Layouts of 1 to 40 groups (and a few of 500) with 0 to 5 negatives each, plus the
    edge cases: one group, no negatives anywhere, one negative-rich group."""
    rng = random.Random(seed)
    yield [0]
    yield [3]
    yield [0] * 7
    yield [12]
    yield [0, 9, 0]
    for i in range(n):
        n_groups = rng.randint(1, 500) if i % 50 == 0 else rng.randint(1, 40)
        yield [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(n_groups)]


def test_torch_and_numpy_splitters_agree_on_random_layouts():
    for counts in random_layouts():
        labels = group_labels(counts)
        n_rows = len(labels) + len(counts)
        want = reference_groups(counts)
        torch_parts = split_groups(torch.tensor(labels, dtype=torch.float32), n_rows)
        assert [t.tolist() for t in torch_parts] == list(want), counts
        for dtype in (np.float64, np.float32, np.int64):
            numpy_parts = split_groups_numpy(np.array(labels, dtype=dtype), n_rows)
            assert [a.tolist() for a in numpy_parts] == list(want), (counts, dtype)


def test_numpy_splitter_takes_a_read_only_array_without_a_warning():
    labels = np.array(group_labels([1, 0, 2]))
    labels.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        anchors, *_ = split_groups_numpy(labels, 9)
    assert anchors.tolist() == [0, 3, 5]


BAD_GROUP_LAYOUTS = [
    ([1.0, 0, 0, 1], 5, "must have 6 rows"),  # labels length != N - B
    ([1.0, 0, 0, 1], 7, "must have 6 rows"),
    ([0.0, 1, 0], 4, "group 0 has no positive"),
    ([0.0, 1, 0], 4, "must start with a 1.0"),
    ([0.0, 0.0], 2, "no 1.0 entry"),
    ([], 0, "empty"),
    ([1.0, 0.5, 1], 5, r"labels\[1\] = 0.5"),
    ([1.0, 2.0], 3, r"labels\[1\] = 2.0"),
    ([1.0, float("nan")], 3, r"labels\[1\] = nan"),
    ([1.0, 0.0, -1.0], 4, "1.0 .positive. or 0.0 .negative."),
    ([[1.0, 0.0]], 3, "1-D"),
]


@pytest.mark.parametrize("labels, n_rows, message", BAD_GROUP_LAYOUTS)
def test_torch_and_numpy_splitters_fail_alike(labels, n_rows, message):
    with pytest.raises(ValueError, match=message) as from_torch:
        split_groups(torch.tensor(labels, dtype=torch.float64), n_rows)
    with pytest.raises(ValueError, match=message) as from_numpy:
        split_groups_numpy(np.array(labels, dtype=np.float64), n_rows)
    assert str(from_numpy.value) == str(from_torch.value)


def test_random_bad_labels_fail_alike():
    """Random layouts broken one way at a time: a stray value, a wrong row count, a leading
    negative. Both splitters raise, with the same message."""
    rng = random.Random(1)
    for counts in list(random_layouts(seed=2, n=60)):
        labels = group_labels(counts)
        n_rows = len(labels) + len(counts)
        i = rng.randrange(len(labels))
        for bad, rows in [
            (labels[:i] + [rng.choice([0.25, -1.0, 3.0])] + labels[i + 1 :], n_rows),
            (labels, n_rows + rng.choice([-1, 1, 2])),
            ([0.0] + labels, n_rows + 1),
        ]:
            with pytest.raises(ValueError) as from_torch:
                split_groups(torch.tensor(bad, dtype=torch.float64), rows)
            with pytest.raises(ValueError) as from_numpy:
                split_groups_numpy(np.array(bad), rows)
            assert str(from_numpy.value) == str(from_torch.value), (counts, bad, rows)


def test_split_pair_rows_on_torch_and_numpy():
    rows = np.arange(12.0).reshape(6, 2)  # s1_0 s2_0 | s1_1 s2_1 | s1_2 s2_2
    for x in (rows, torch.from_numpy(rows)):
        s1, s2 = split_pair_rows(x, 3)
        assert type(s1) is type(x) and tuple(s1.shape) == (3, 2)
        assert s1.tolist() == [[0, 1], [4, 5], [8, 9]] and s2.tolist() == [[2, 3], [6, 7], [10, 11]]
    for bad, n_labels, message in [(rows[:5], 2, "alternate sentence1, sentence2"),
                                   (rows[:, 0], 3, "alternate sentence1, sentence2"),
                                   (rows, 4, "3 pairs but 4 labels")]:
        with pytest.raises(ValueError, match=message) as from_numpy:
            split_pair_rows(bad, n_labels)
        with pytest.raises(ValueError, match=message) as from_torch:
            split_pair_rows(torch.from_numpy(np.ascontiguousarray(bad)), n_labels)
        assert str(from_numpy.value) == str(from_torch.value)


def test_the_collator_rows_follow_the_layout_given_as_the_enum():
    """The functions take the enum only: a value (``"pair"``) is converted where it enters
    (``Layout("pair")``, or a loss class's declaration), and the collator refuses anything else."""
    sample = Sample(Item("q"), [Item("p"), Item("p2")], [Item("n0"), Item("n1")], label=0.5, source="f.jsonl", line=3)
    items, labels = sample_items(sample, Layout.GROUP)
    assert [it.text for it in items] == ["q", "p", "n0", "n1"] and labels == [1.0, 0.0, 0.0]
    assert [o[2] for o in item_origins(sample, Layout.GROUP)] == [
        "query", "response", "rejected_response[0]", "rejected_response[1]"]
    items, labels = sample_items(sample, Layout.PAIR)
    assert [it.text for it in items] == ["q", "p"] and labels == [0.5]
    assert [o[2] for o in item_origins(sample, Layout.PAIR)] == ["query", "response"]
    with pytest.raises(ValueError, match="triplet"):
        Layout("triplet")
    for value in ("pair", "triplet"):
        with pytest.raises(TypeError, match=f"layout must be Layout.GROUP or Layout.PAIR .*got '{value}'"):
            EmbeddingCollator(get_template("bert"), None, value)


def test_the_layout_is_parsed_in_one_place():
    """Only encoding/layout.py defines a splitter; losses/base.py imports it from there (it
    imported infonce lazily for it: a circle)."""
    package = os.path.join(REPO, "mmembed")
    homes = {}
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                tree = ast.parse(open(path, encoding="utf-8").read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.FunctionDef) and node.name in {
                            "split_groups", "split_groups_numpy", "split_pair_rows", "_split_infonce_layout"}:
                        homes.setdefault(node.name, []).append(os.path.relpath(path, package))
    assert homes == {name: [os.path.join("encoding", "layout.py")]
                     for name in ("split_groups", "split_groups_numpy", "split_pair_rows")}
    base = ast.parse(open(os.path.join(package, "losses", "base.py"), encoding="utf-8").read())
    imported = {(n.module, n.level) for n in ast.walk(base) if isinstance(n, ast.ImportFrom)}
    assert ("infonce", 1) not in imported and ("encoding.layout", 2) in imported
