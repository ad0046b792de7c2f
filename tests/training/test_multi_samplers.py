"""The samplers of several datasets and of duplicate-free batches (mmembed/training/samplers.py):
``--multi_dataset_sampler proportional | round_robin | weighted``, ``--batch_sampler
no_duplicates``, ``--interleave_prob`` / ``--stopping_strategy`` and the sampler's position in a
checkpoint. The references are counted here from the rows each process was given: which dataset
each row belongs to is fixed by the test (row ranges, or the row's own text), never read back from
the sampler."""

from __future__ import annotations

import json
import math
import os
import shutil
import types
from collections import Counter

import numpy as np
import pytest
from conftest import REPO, launch, stsb_pairs, write_jsonl

import mmembed.training.samplers as samplers
from mmembed.data.sample import Item, Sample
from mmembed.errors import UsageError
from mmembed.training.batch_samplers import Part, duplicate_free_batches, row_keys
from mmembed.training.samplers import (
    BATCH_SAMPLERS,
    HOMOGENEOUS_SAMPLERS,
    MULTI_DATASET_SAMPLERS,
    HomogeneousSampler,
    MappedSampler,
    MultiDatasetSampler,
    PooledSampler,
    ProportionalSampler,
    RoundRobinSampler,
    WeightedSampler,
    check_resumed_state,
    pass_through_shards,
    train_sampler,
)

# three datasets as row ranges of one training set: a 0-39, b 40-99, c 100-129
SIZES = {"a": 40, "b": 60, "c": 30}


def _parts(weights=(1.0, 1.0, 1.0)) -> list[Part]:
    parts, start = [], 0
    for (name, n), w in zip(SIZES.items(), weights):
        parts.append(Part(name, w, np.arange(start, start + n)))
        start += n
    return parts


def _owner(row: int) -> str:
    """The dataset of a row, from the ranges above."""
    start = 0
    for name, n in SIZES.items():
        if row < start + n:
            return name
        start += n
    raise AssertionError(row)


def _global_batches(rule, epoch, batch=2, accumulation=3, world=2, seed=5, parts=None, keys=None):
    """Every step's global batch of ``epoch``, put together from each process's sampler as the
    trainer reads it: process r's micro-batch k of step s is its sampler's rows
    ``(s * accumulation + k) * batch`` to ``+ batch``; returns ``[step][process][micro] -> rows``."""
    per_process = []
    for rank in range(world):
        s = HOMOGENEOUS_SAMPLERS[rule](parts or _parts(), batch, accumulation, seed, rank, world, keys=keys)
        s.set_epoch(epoch)
        rows = list(s)
        assert len(rows) == len(s)
        per_process.append([rows[i:i + batch] for i in range(0, len(rows), batch)])
    steps = len(per_process[0]) // accumulation
    return [[per_process[r][s * accumulation:(s + 1) * accumulation] for r in range(world)] for s in range(steps)]


def _flat(step) -> list[int]:
    return [i for process in step for micro in process for i in micro]


@pytest.mark.parametrize("rule", ["proportional", "round_robin", "weighted"])
def test_every_global_batch_is_one_datasets_split_among_the_processes(rule):
    """Per-device batch 2, 2 processes, 3 accumulation steps: each step's 12 rows (all
    processes, all micro-batches) are 12 different rows of one dataset, every micro-batch full."""
    for epoch in range(3):
        for step in _global_batches(rule, epoch):
            rows = _flat(step)
            assert len(rows) == 12 == len(set(rows))
            assert len({_owner(i) for i in rows}) == 1, rows
            assert all(len(micro) == 2 for process in step for micro in process)


def test_proportional_is_one_pass_over_each_dataset_per_epoch():
    """Each epoch draws dataset d floor(rows / 12) times (a: 3, b: 5, c: 2): every row at most once,
    and rows % 12 of each sit the epoch out; the datasets' order differs from epoch to epoch."""
    orders = []
    for epoch in range(3):
        steps = _global_batches("proportional", epoch)
        names = [_owner(_flat(s)[0]) for s in steps]
        assert Counter(names) == {"a": 3, "b": 5, "c": 2}
        used = [i for s in steps for i in _flat(s)]
        assert len(used) == len(set(used)) == 120
        assert Counter(_owner(i) for i in used) == {"a": 36, "b": 60, "c": 24}
        orders.append(names)
    assert orders[0] != orders[1] or orders[1] != orders[2]


def test_round_robin_takes_the_datasets_in_turn_and_the_larger_ones_go_on_next_epoch():
    """c (30 rows) has 2 global batches of 12: two rounds a, b, c per epoch. b (60 rows, 5 batches)
    goes on where it stopped: its first 5 batches over epochs 0-2 are one pass (60 different rows)."""
    b_rows = []
    for epoch in range(3):
        steps = _global_batches("round_robin", epoch)
        assert [_owner(_flat(s)[0]) for s in steps] == ["a", "b", "c"] * 2
        b_rows += [_flat(s) for s in steps if _owner(_flat(s)[0]) == "b"]
    first_pass = [i for batch in b_rows[:5] for i in batch]
    assert sorted(first_pass) == list(range(40, 100))


def test_weighted_shares_match_the_weights_within_sampling_error():
    """Weights 1 : 2 : 5 over 60 epochs (600 global batches): each dataset's count of global
    batches is within 4 standard deviations of its binomial expectation."""
    weights = (1.0, 2.0, 5.0)
    counts, total = Counter(), 0
    sampler = WeightedSampler(_parts(weights), 2, 1, seed=11, rank=0, world=1)
    for epoch in range(60):
        sampler.set_epoch(epoch)
        rows = list(sampler)
        for i in range(0, len(rows), 2):
            batch = rows[i:i + 2]
            assert len({_owner(r) for r in batch}) == 1
            counts[_owner(batch[0])] += 1
            total += 1
    assert total == 60 * (20 + 30 + 15)
    for name, w in zip(SIZES, weights):
        p = w / sum(weights)
        assert abs(counts[name] - total * p) < 4 * math.sqrt(total * p * (1 - p)), (name, counts, total)


def test_weighted_reuses_a_dataset_only_after_a_whole_pass():
    """c weighs most but has 30 rows: its rows repeat only after every one of them was drawn once."""
    sampler = WeightedSampler(_parts((1.0, 1.0, 20.0)), 3, 1, seed=2, rank=0, world=1)
    c_rows = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        c_rows += [i for i in sampler if _owner(i) == "c"]
    assert len(c_rows) >= 60
    assert sorted(c_rows[:30]) == list(range(100, 130)) == sorted(c_rows[30:60])


def test_the_order_follows_the_seed():
    one = [_flat(s) for s in _global_batches("weighted", 1, seed=3)]
    assert one == [_flat(s) for s in _global_batches("weighted", 1, seed=3)]
    assert one != [_flat(s) for s in _global_batches("weighted", 1, seed=4)]


def test_a_dataset_smaller_than_one_global_batch_is_refused_by_name():
    parts = _parts() + [Part("tiny", 1.0, np.arange(130, 140))]
    with pytest.raises(UsageError) as e:
        ProportionalSampler(parts, 4, 2, seed=0, rank=0, world=2)
    message = str(e.value)
    assert "'tiny' has 10 training row(s)" in message and "global batch of 16 rows" in message
    assert "--per_device_train_batch_size 4 x 2 process(es) x --gradient_accumulation_steps 2" in message


def test_the_start_up_check_counts_every_process_before_the_model_loads(caplog):
    """check_sampling (build_trainer calls it before the model loads, when no process group runs
    yet) takes the process count from the arguments: 2 x 2 x 2 = 8 rows per global batch refuse
    a 7-row dataset; when training starts the sampler logs each dataset's plan."""
    rows = _Rows(range(27))
    rows.dataset_ids = np.array([0] * 20 + [1] * 7)
    infos = [types.SimpleNamespace(name="retrieval", weight=1.0), types.SimpleNamespace(name="sts", weight=1.0)]
    args = _args(multi_dataset_sampler="round_robin", world_size=2)
    with pytest.raises(UsageError, match="dataset 'sts' has 7 training row"):
        samplers.check_sampling(args, rows, infos)
    samplers.check_sampling(_args(multi_dataset_sampler="round_robin"), rows, infos)  # one process: 4 rows
    with caplog.at_level("INFO", logger="mmembed"):
        train_sampler(rows, _args(multi_dataset_sampler="round_robin"), infos)
    assert "retrieval: 20 rows, 5 global batches per pass (0 rows sit each pass out)" in caplog.text
    assert "sts: 7 rows, 1 global batches per pass (3 rows sit each pass out), 1 of the first epoch's 2 steps" \
        in caplog.text


# ----------------------------------------------------------------------------- no_duplicates

def _item(text, images=()):
    return Item(text=text, images=list(images))


def _duplicate_rows(n=90, seed=0) -> list[Sample]:
    """Rows whose positives come from 12 texts, whose negatives come from 40 (two different ones
    per row), a third of whose anchors repeat another's, and whose images tell apart texts that
    are otherwise the same."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        anchor = f"query {i % 60}"
        positive = _item(f"doc {rng.integers(12)}", [f"/img/{i % 2}.png"])
        negatives = [_item(f"neg {k}") for k in rng.choice(40, size=2, replace=False)]
        rows.append(Sample(anchor=_item(anchor), positives=[positive], negatives=negatives))
    return rows


def _texts(sample: Sample) -> list[tuple]:
    """Each text of a row with its media, written out here (the reference)."""
    return [(x.text, tuple(x.images), tuple(x.videos), tuple(x.audios))
            for x in (sample.anchor, *sample.positives, *sample.negatives)]


class _Rows(list):
    """A training set of Samples with the datasets' indices, as TrainingData gives them."""


def _args(**fields):
    a = types.SimpleNamespace(train_sampling_strategy="random", train_dataloader_shuffle=True, seed=42, data_seed=7,
                              per_device_train_batch_size=2, gradient_accumulation_steps=2, world_size=1,
                              multi_dataset_sampler="mixed", batch_sampler="default", interleave_prob=None,
                              stopping_strategy="first_exhausted")
    a.__dict__.update(fields)
    return a


@pytest.mark.parametrize("rule", ["mixed", "proportional", "weighted"])
def test_no_duplicates_never_repeats_a_text_in_a_global_batch(rule, monkeypatch):
    """2 processes x 2 rows x 2 micro-batches: no (text, media) twice among the 8 rows' anchors,
    positives and negatives of any step, under mixed and the one-dataset-per-batch samplers;
    without no_duplicates the same rows do repeat texts (the check can fail)."""
    rows = _Rows(_duplicate_rows())
    rows.dataset_ids = np.array([0] * 45 + [1] * 45)
    world = 2
    repeated = 0
    for batch_sampler in ("no_duplicates", "default"):
        if rule == "mixed" and batch_sampler == "default":
            continue
        shares = []
        for rank in range(world):
            monkeypatch.setattr(samplers, "world", lambda rank=rank: (rank, world))
            s = train_sampler(rows, _args(multi_dataset_sampler=rule, batch_sampler=batch_sampler))
            assert isinstance(s, HomogeneousSampler)
            s.set_epoch(1)
            shares.append(list(s))
        assert len(shares[0]) == len(shares[1]) > 0 and len(shares[0]) % 4 == 0
        for step in range(len(shares[0]) // 4):
            batch = [i for r in range(world) for i in shares[r][step * 4:(step + 1) * 4]]
            texts = [t for i in batch for t in _texts(rows[i])]
            if batch_sampler == "no_duplicates":
                assert len(texts) == len(set(texts)), batch
                if rule != "mixed":
                    assert len({int(rows.dataset_ids[i]) for i in batch}) == 1
            else:
                repeated += len(texts) != len(set(texts))
    assert rule == "mixed" or repeated > 0


def test_duplicate_free_batches_keep_a_waiting_row_for_the_next_batch():
    """Written out: rows 0 and 1 share a text; batches of 2 from order 0, 1, 2, 3, 4 are [0, 2]
    (1 waits), [1, 3]; row 4 alone fills no batch."""
    keys = [frozenset({1}), frozenset({1, 2}), frozenset({3}), frozenset({4}), frozenset({5})]
    assert duplicate_free_batches([0, 1, 2, 3, 4], keys, 2) == [[0, 2], [1, 3]]
    assert duplicate_free_batches([0, 1], keys, 2) == []


def test_no_duplicates_reads_the_arrow_rows(tmp_path):
    """The training set as mmembed loads it (Arrow, rows as JSON): two rows with the same positive
    never share a batch of 2; the same text with another image is not a duplicate."""
    from mmembed.data import EmbeddingDataset, load_samples

    img = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(img)
    rows = [{"query": "q0", "response": "same"}, {"query": "q1", "response": "same"},
            {"query": "q2", "response": "other"}, {"query": "q3", "response": "<image>same", "images": [str(img)]}]
    data = EmbeddingDataset(load_samples([write_jsonl(tmp_path / "d.jsonl", rows)], shuffle=False).dataset)
    keys = row_keys(data)
    texts = {data[i].anchor.text: i for i in range(4)}
    assert keys[texts["q0"]] & keys[texts["q1"]]  # the shared positive
    assert not keys[texts["q0"]] & keys[texts["q3"]] and not keys[texts["q0"]] & keys[texts["q2"]]


# ----------------------------------------------------------------------------- --interleave_prob

def test_interleave_prob_is_datasets_interleaving_with_normalised_probabilities(monkeypatch, caplog):
    """ms-swift's meaning: rows drawn dataset by dataset with the probabilities (2 : 6 is 0.25 :
    0.75); first_exhausted stops when one dataset has given all its rows (no row twice),
    all_exhausted when every one has (each row at least once); ms-swift's per-epoch shuffle
    then runs over those rows."""
    monkeypatch.setattr(samplers, "world", lambda: (0, 1))
    rows = _Rows(range(130))
    rows.dataset_ids = np.array([0] * 40 + [1] * 60 + [2] * 30)
    with caplog.at_level("INFO", logger="mmembed"):
        first = train_sampler(rows, _args(interleave_prob=[2, 6, 2]))
    assert "probabilities dataset 0 0.2, dataset 1 0.6, dataset 2 0.2 (normalised to sum 1)" in caplog.text
    assert isinstance(first, MappedSampler)
    same = train_sampler(rows, _args(interleave_prob=[0.2, 0.6, 0.2]))
    assert list(first) == list(same)
    drawn = Counter(int(rows.dataset_ids[i]) for i in first.rows)
    assert len(set(first.rows.tolist())) == len(first.rows)  # first_exhausted: no row twice
    assert any(drawn[d] == n for d, n in enumerate((40, 60, 30)))  # one dataset given whole
    assert drawn[1] > drawn[0] and drawn[1] > drawn[2]
    every = train_sampler(rows, _args(interleave_prob=[2, 6, 2], stopping_strategy="all_exhausted"))
    assert set(every.rows.tolist()) == set(range(130)) and len(every.rows) > 130  # oversampled
    assert sorted(every) == sorted(every.rows.tolist())  # the epoch is those rows, shuffled


def test_interleave_prob_refusals(monkeypatch):
    from mmembed.training.arguments import SftArguments

    rows = _Rows(range(130))
    rows.dataset_ids = np.array([0] * 40 + [1] * 60 + [2] * 30)
    with pytest.raises(UsageError, match="2 probabilities for 3 dataset"):
        train_sampler(rows, _args(interleave_prob=[1, 1]))
    model = os.path.join(REPO, "tests")  # not loaded: the flags are refused first
    for flags, words in [({"interleave_prob": [1, 1], "multi_dataset_sampler": "weighted"}, "with --multi_dataset_sampler weighted"),
                         ({"stopping_strategy": "all_exhausted", "multi_dataset_sampler": "round_robin"}, "--stopping_strategy"),
                         ({"interleave_prob": [1, -1]}, "--interleave_prob takes"),
                         ({"multi_dataset_sampler": "by_size"}, "--multi_dataset_sampler must be one of"),
                         ({"batch_sampler": "unique"}, "--batch_sampler must be")]:
        with pytest.raises(UsageError, match=words):
            SftArguments(model=model, dataset=["x.jsonl"], output_dir="/tmp/never", **flags)


# ----------------------------------------------------------------------------- the position, resuming

def test_the_recorded_position_counts_the_global_batches_drawn(tmp_path):
    """After each step of two epochs, the state's per-dataset count equals the count of that
    dataset's global batches among the steps so far; a checkpoint with the state resumes, one
    whose state another run would not reach is refused."""
    sampler = WeightedSampler(_parts((1.0, 3.0, 1.0)), 2, 3, seed=9, rank=0, world=2)
    seen = Counter()
    step = 0
    for epoch in range(2):
        for s in _global_batches("weighted", epoch, seed=9, parts=_parts((1.0, 3.0, 1.0))):
            seen[_owner(_flat(s)[0])] += 1
            step += 1
            state = sampler.state(step)
            assert [d["global_batches_drawn"] for d in state["datasets"]] == [seen[n] for n in SIZES]
    ckpt = tmp_path / "checkpoint-13"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 13}))
    (ckpt / samplers.STATE_FILE).write_text(json.dumps(sampler.state(13)))
    check_resumed_state(sampler, str(ckpt))
    other = WeightedSampler(_parts((1.0, 3.0, 1.0)), 2, 3, seed=10, rank=0, world=2)
    with pytest.raises(UsageError, match="would not train on the batches"):
        check_resumed_state(other, str(ckpt))


def test_accelerate_sharding_passes_each_processs_share_through(monkeypatch):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, DataLoader

    monkeypatch.setattr(samplers, "world", lambda: (1, 2))
    sampler = RoundRobinSampler(_parts(), 2, 2, seed=0, rank=1, world=2)
    shard = BatchSamplerShard(BatchSampler(sampler, 2, drop_last=False), num_processes=2, process_index=1)
    loader = pass_through_shards(DataLoader(list(range(130)), batch_sampler=shard))
    assert [i for b in loader for i in b.tolist()] == list(sampler)


# ----------------------------------------------------------------------------- a real two-process run

WEIGHTS = {"a": 1.0, "b": 2.0, "c": 1.0}
ROWS = {"a": 8, "b": 16, "c": 8}


def _run(tmp_path, minilm_path, out, tag, **flags):
    pairs, files = iter(stsb_pairs(sum(ROWS.values()))), []
    for name, n in ROWS.items():  # one file per dataset
        files.append(write_jsonl(tmp_path / f"{name}.jsonl",
                                 [{**p, "query": f"{name} {i}: {p['query']}"} for i, p in zip(range(n), pairs)]))
    config = tmp_path / "datasets.json"  # one dataset per file, weighted
    config.write_text(json.dumps([{"name": n, "path": f, "weight": WEIGHTS[n]} for n, f in zip(ROWS, files)]))
    args = dict(model=minilm_path, dataset_config=str(config), output_dir=str(out), per_device_train_batch_size=2,
                gradient_accumulation_steps=2, gradcache_mini_batch_size=1, max_steps=7, save_steps=5, max_length=32,
                multi_dataset_sampler="weighted", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
                logging_steps=1, **flags)
    record = tmp_path / tag
    launch(["tests/sampler_worker.py", "--out", str(record), "--weights", json.dumps(WEIGHTS),
            "--flags", json.dumps(args)], nproc=2, timeout=300)
    return [json.loads((tmp_path / f"{tag}.{r}").read_text()) for r in range(2)]


def _steps(recorded, first_step, last_step, accumulation=2):
    """Global batch of each step: every process's micro-batches of it (the collators' records,
    which may hold one batch read ahead beyond the last step)."""
    out = {}
    for s in range(first_step, last_step + 1):
        k = (s - first_step) * accumulation
        out[s] = [row for process in recorded for micro in process[k:k + accumulation] for row in micro]
    return out


def test_two_processes_train_on_homogeneous_global_batches_and_resume_on_the_same_ones(tmp_path, minilm_path):
    """torchrun, 2 processes (gloo), per-device batch 2, gradient cache chunks of 1 row, 2
    accumulation steps: every optimizer step's 8 rows are 8 different rows of one dataset, as the
    sampler computes them for that step; checkpoint-5 records each dataset's global batches drawn
    in steps 1-5; resumed from it (a second run, in epoch 2 of 4 steps each), steps 6 and 7 train
    on the rows the uninterrupted run trained on."""
    full = _run(tmp_path, minilm_path, tmp_path / "full", "full")
    steps = _steps(full, 1, 7)
    names = {}
    for s, rows in steps.items():
        assert len(rows) == 8 == len(set(rows)), (s, rows)
        owners = {r.split()[0] for r in rows}
        assert len(owners) == 1, (s, rows)
        names[s] = owners.pop()
    # the datasets of the steps are the draws of the unit-level sampler (whose shares are
    # tested above) for these sizes, weights and --data_seed 42: epoch 0's 4 steps, then epoch 1's
    sizes = [Part(n, WEIGHTS[n], np.arange(ROWS[n])) for n in WEIGHTS]
    unit = WeightedSampler(sizes, 2, 2, seed=42, rank=0, world=2)
    assert [names[s] for s in range(1, 8)] == [list(WEIGHTS)[d] for d in [*unit.draws(0), *unit.draws(1)[:3]]]
    state = json.loads((tmp_path / "full" / "checkpoint-5" / samplers.STATE_FILE).read_text())
    drawn = {d["name"]: d["global_batches_drawn"] for d in state["datasets"]}
    assert drawn == {n: sum(1 for s in range(1, 6) if names[s] == n) for n in WEIGHTS}
    assert (state["epoch"], state["batch_in_epoch"], state["batches_per_epoch"]) == (1, 1, 4)
    # resumed from checkpoint-5 in a copy of the run
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed_dir, ignore=shutil.ignore_patterns("checkpoint-7"))
    resumed = _run(tmp_path, minilm_path, resumed_dir, "resumed",
                   resume_from_checkpoint=str(resumed_dir / "checkpoint-5"))
    again = _steps(resumed, 6, 7)
    assert again == {6: steps[6], 7: steps[7]}


@pytest.mark.parametrize("make", [
    lambda rank: samplers.SwiftOrderSampler(20, True, 42, rank=rank, world=2),
    lambda rank: ProportionalSampler(_parts(), 2, 1, seed=3, rank=rank, world=2),
], ids=["mixed", "proportional"])
def test_a_resumed_epoch_reaches_the_sampler_through_accelerates_skipping_loader(make, tmp_path, monkeypatch):
    """Two processes, resumed 2 steps into the second epoch: the
    Trainer skips the epoch's trained batches with accelerate's skip_first_batches and sets the
    epoch on that loader, which does not reach the sampler; resumed_epoch sets it, and the
    resumed loader gives the uninterrupted epoch's batches after the skipped ones (without it,
    epoch 0's)."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, skip_first_batches
    from torch.utils.data import BatchSampler

    monkeypatch.setattr(samplers, "world", lambda: (1, 2))

    def loader():
        sampler = make(1)
        shard = BatchSamplerShard(BatchSampler(sampler, 2, drop_last=False), num_processes=2, process_index=1)
        return sampler, pass_through_shards(DataLoaderShard(list(range(130)), batch_sampler=shard))

    _, full = loader()
    per_epoch = len(full)
    epochs = []
    for epoch in range(2):
        full.set_epoch(epoch)
        epochs.append([b.tolist() for b in full])
    assert epochs[0] != epochs[1]
    step = per_epoch + 2
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    epoch, skip = divmod(step, per_epoch)
    for fixed in (True, False):
        sampler, resumed = loader()
        if fixed:
            samplers.resumed_epoch(sampler, len(resumed), 1, str(tmp_path))
        skipped = skip_first_batches(resumed, skip)
        skipped.set_epoch(epoch)  # as the Trainer does
        got = [b.tolist() for b in skipped]
        assert (got == epochs[epoch][skip:]) == fixed


# ----------------------------------------------------------------------------- each rule, written out

def _dataset_batch(d: int, k: int, seed: int = 5, size: int = 12, rows=None) -> list[int]:
    """Dataset ``d``'s ``k``-th global batch, the reference: pass ``k // per_pass`` is its rows
    permuted with ``default_rng([seed, d, pass])``, cut into whole batches of ``size``."""
    rows = _parts()[d].rows if rows is None else rows
    per_pass = len(rows) // size
    p, j = divmod(k, per_pass)
    order = rows[np.random.default_rng([seed, d, p]).permutation(len(rows))]
    return order[j * size:(j + 1) * size].tolist()


def _in_order(step, world: int = 2, accumulation: int = 3) -> list[int]:
    """A step's global batch in its order: micro-batch k of process r holds its rows (k * world + r) * B to + B."""
    return [i for k in range(accumulation) for r in range(world) for i in step[r][k]]


def _composed(draws_per_epoch) -> list[list[list[int]]]:
    """Each epoch's global batches when each step takes the next global batch of the dataset drawn."""
    drawn, epochs = Counter(), []
    for draws in draws_per_epoch:
        epochs.append([])
        for d in draws:
            epochs[-1].append(_dataset_batch(d, drawn[d]))
            drawn[d] += 1
    return epochs


def _sampled(rule, epochs: int = 3, parts=None) -> list[list[list[int]]]:
    return [[_in_order(s) for s in _global_batches(rule, e, parts=parts)] for e in range(epochs)]


def test_round_robin_written_out():
    """a, b, c in turn, two rounds an epoch (c has 2 global batches of 12): a's batches 0, 1 in
    epoch 0, 2, 3 in epoch 1, ... (a new pass after its 3rd)."""
    assert _sampled("round_robin") == _composed([[0, 1, 2, 0, 1, 2]] * 3)


def test_proportional_written_out():
    """Each epoch a: 3, b: 5, c: 2 global batches in the order permuted with default_rng([seed, epoch, 2])."""
    draws = [np.random.default_rng([5, e, 2]).permutation([0, 0, 0, 1, 1, 1, 1, 1, 2, 2]).tolist() for e in range(3)]
    assert _sampled("proportional") == _composed(draws)


def test_weighted_written_out():
    """Each epoch 10 draws (as many as proportional), dataset d with probability weight / sum,
    drawn with default_rng([seed, epoch, 4]); a dataset's batches run on over the epochs."""
    weights = np.array([1.0, 3.0, 1.0])
    draws = [np.random.default_rng([5, e, 4]).choice(3, size=10, p=weights / weights.sum()).tolist()
             for e in range(3)]
    assert _sampled("weighted", parts=_parts(tuple(weights))) == _composed(draws)


def test_pooled_is_one_dataset_of_all_rows_without_a_text_twice():
    """mixed with no_duplicates: the rows of every dataset as one part, its global batches in turn
    (10 an epoch of 130 rows); without repeated texts, exactly the plain batches of that part."""
    pooled = [Part("all rows", 1.0, np.arange(130))]
    keys = [frozenset({i}) for i in range(130)]
    every = [_dataset_batch(0, k, rows=np.arange(130)) for k in range(30)]
    assert [b for e in _sampled("mixed", parts=pooled) for b in e] == every
    s = HOMOGENEOUS_SAMPLERS["mixed"](pooled, 2, 3, 5, 0, 2, keys=keys)
    assert isinstance(s, PooledSampler) and s.no_duplicates and s.state(0)["sampler"] == "mixed"
    with pytest.raises(ValueError, match="one part of all rows"):
        PooledSampler(_parts(), 2, 3, 5, 0, 2)
    with pytest.raises(UsageError, match="--batch_sampler no_duplicates takes whole global batches: 10 training"):
        PooledSampler([Part("all rows", 1.0, np.arange(10))], 2, 3, 5, 0, 2)


def test_the_options_are_enums_with_the_flags_values():
    assert MULTI_DATASET_SAMPLERS == ("mixed", "proportional", "round_robin", "weighted")
    assert BATCH_SAMPLERS == ("default", "no_duplicates")
    assert MultiDatasetSampler("round_robin") is MultiDatasetSampler.ROUND_ROBIN == "round_robin"
    assert f"--multi_dataset_sampler {MultiDatasetSampler.WEIGHTED}" == "--multi_dataset_sampler weighted"
    assert {rule.value: cls.__name__ for rule, cls in HOMOGENEOUS_SAMPLERS.items()} == {
        "mixed": "PooledSampler", "proportional": "ProportionalSampler", "round_robin": "RoundRobinSampler",
        "weighted": "WeightedSampler"}


class _SizesOnly:
    """A training set whose rows must not be read: the plan needs its length and dataset ids only."""

    dataset_ids = np.array([0] * 40 + [1] * 60 + [2] * 30)

    def __len__(self):
        return 130

    def __getitem__(self, i):
        raise AssertionError("the plan read a row")


@pytest.mark.parametrize("flags, sampler, parts", [
    ({}, None, None),
    ({"batch_sampler": "no_duplicates"}, "PooledSampler", [("all rows", 130)]),
    ({"multi_dataset_sampler": "proportional"}, "ProportionalSampler", [("dataset 0", 40), ("dataset 1", 60),
                                                                        ("dataset 2", 30)]),
    ({"multi_dataset_sampler": "round_robin", "batch_sampler": "no_duplicates"}, "RoundRobinSampler", 3),
    ({"multi_dataset_sampler": "weighted"}, "WeightedSampler", 3),
    ({"interleave_prob": [1, 1, 1]}, None, 3),
])
def test_the_plan_is_made_from_the_flags_and_the_sizes(flags, sampler, parts, monkeypatch):
    monkeypatch.setattr(samplers, "world", lambda: (1, 2))
    plan = samplers.plan_sampling(_args(**flags), _SizesOnly(), rank=1, world=2)
    assert (plan.sampler.__name__ if plan.sampler else None) == sampler
    if isinstance(parts, int):
        assert len(plan.parts) == parts
    else:
        assert (parts is None and plan.parts is None) or [(p.name, len(p.rows)) for p in plan.parts] == parts
    assert (plan.rank, plan.world, plan.seed, plan.shuffle) == (1, 2, 7, True)
    if "interleave_prob" in flags:
        assert plan.rows is not None and isinstance(samplers.build_sampler(plan, _SizesOnly()), MappedSampler)
    elif sampler is None:
        assert isinstance(samplers.build_sampler(plan, _SizesOnly()), samplers.SwiftOrderSampler)
    elif "batch_sampler" not in flags:  # (no_duplicates reads the rows' texts when it is built)
        built = samplers.build_sampler(plan, _SizesOnly())
        assert type(built).__name__ == sampler and (built.rank, built.world, built.size) == (1, 2, 8)
    assert samplers.plan_sampling(_args(train_sampling_strategy="group_by_length"), _SizesOnly()) is None
    assert samplers.plan_sampling(_args(**flags), iter(range(3))) is None
