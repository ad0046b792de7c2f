"""``--packing true`` (mmembed.training.sample_packs): ms-swift 4.6's packs of whole rows.

- the packs equal ms-swift's own (its PackingDataset.create_packed_idx and split_list, run in
  the ms-swift venv named by MMEMBED_SWIFT_PYTHON; skipped without it) for random lengths over
  several groups of a thousand, both strategies, one and three shares; and, always, the
  binpacking library's bins for one group, every row once, every pack within the budget;
- a row's length is the sum of its inputs' tokens as the collator gives them to the model
  (each input collated alone, its attention mask summed), cut to --max_length when truncating;
- training draws whole packs in ms-swift's order and a step's batch is the rows of its packs,
  so the loss is the loss of those rows (a reranker too); the flags that cannot go with it
  are refused before anything loads.
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import numpy as np
import pytest
import torch
from conftest import write_jsonl

from mmembed.errors import UsageError
from mmembed.training.sample_packs import PACK_GROUP, pack_indices

SWIFT_PACKS = r"""
import json, sys
from swift.dataset.packing import PackingDataset
from swift.utils import split_list
import math
lengths, budget, strategy, num_proc = json.loads(sys.stdin.read())
num_proc = min(num_proc, math.ceil(len(lengths) / PackingDataset.PACKING_BATCH_SIZE))
class Q:
    def __init__(self): self.items = []
    def put(self, x): self.items.append(x)
packs = []
offset = 0
for rank, chunk in enumerate(split_list(lengths, num_proc)):
    q = Q()
    PackingDataset.create_packed_idx(rank, offset, chunk, q, budget, strategy)
    offset += len(chunk)
    for _, sequences, n in q.items:
        packs += [[x[0] for x in seq] for seq in sequences]
print(json.dumps(packs))
"""


def random_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(5, 60), rng.randint(60, 400), rng.randint(400, 1200)]) for _ in range(n)]


@pytest.mark.parametrize("strategy", ["binpack", "sequential"])
@pytest.mark.parametrize("num_proc", [1, 3])
def test_packs_are_ms_swifts(strategy, num_proc):
    python = os.environ.get("MMEMBED_SWIFT_PYTHON")
    if not python:
        pytest.skip("ms-swift's packing needs a python with ms-swift 4.6: set MMEMBED_SWIFT_PYTHON")
    lengths = random_lengths(2 * PACK_GROUP + 517, seed=num_proc)
    proc = subprocess.run([python, "-c", SWIFT_PACKS], input=json.dumps([lengths, 1024, strategy, num_proc]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert pack_indices(lengths, 1024, strategy, num_proc) == json.loads(proc.stdout)


@pytest.mark.parametrize("strategy", ["binpack", "sequential"])
def test_every_row_once_within_the_budget(strategy):
    lengths = random_lengths(2 * PACK_GROUP + 31, seed=7) + [5000]  # one row over the budget: a pack of its own
    packs = pack_indices(lengths, 1024, strategy)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for p in packs:
        assert sum(lengths[i] for i in p) <= 1024 or len(p) == 1
    if strategy == "sequential":  # next fit: the rows in their order, a new pack when the next overflows
        assert [i for p in packs for i in p] == list(range(len(lengths)))
        for p, q in zip(packs, packs[1:]):
            assert sum(lengths[i] for i in p) + lengths[q[0]] > 1024 or sum(lengths[i] for i in p) >= 1024
    else:  # fewer packs than next fit, and as the library bins one group
        assert len(packs) < len(pack_indices(lengths, 1024, "sequential"))
        import binpacking

        small = lengths[:300]
        bins = binpacking.to_constant_volume([(i, n) for i, n in enumerate(small)], 1024, weight_pos=1)
        assert pack_indices(small, 1024) == [[i for i, _ in b] for b in bins]


# ---- lengths and training ------------------------------------------------------------------------

ROWS = [{"query": "question " + " ".join(["word"] * k), "response": f"answer {i}",
         "rejected_response": [f"bananas {i}" + " yellow" * (i % 4)] * (i % 3)} for i, k in enumerate([1, 30, 4, 60, 9, 2, 17, 3,
                                                                                               44, 5, 11, 26])]


def parse(folder: str, data: str, tmp_path, *extra: str):
    from mmembed.training.arguments import parse_sft_args

    return parse_sft_args(["--model", folder, "--dataset", data, "--output_dir", str(tmp_path / "out"), "--report_to",
                           "none", "--dataloader_num_workers", "0", "--per_device_train_batch_size", "2",
                           "--packing", "true", "--packing_length", "120", *extra])


@pytest.mark.parametrize("truncation", ["right", "delete"])
def test_a_rows_length_is_its_inputs_as_the_model_gets_them(minilm_path, tmp_path, truncation):
    from mmembed.task import get_task
    from mmembed.training.device_flags import training_padding
    from mmembed.training.length_check import row_token_totals
    from mmembed.training.preflight import check_settings
    from mmembed.training.sft import run_data

    rows = ROWS + [{"query": "long " * 100, "response": "short"}]  # 100+ tokens, over --max_length 64
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    args = parse(minilm_path, data, tmp_path, "--max_length", "64", "--truncation_strategy", truncation)
    setup = check_settings(args)
    setup, encoding, loaded = run_data(args, setup)
    plain = loaded.train.rows
    lengths = row_token_totals(args, encoding, setup.media, setup.loss.layout, get_task(None), plain)
    collator = get_task(None).collator_type()(training_padding(encoding.template, args.padding_side, False),
                                              encoding.processing, setup.loss.layout, encoding.max_length,
                                              truncate=truncation != "delete")
    want = [int(collator([plain[i]])["attention_mask"].sum()) for i in range(len(plain))]
    assert lengths == want
    assert len(plain) == len(rows) - (truncation == "delete")  # delete: the long row is gone
    if truncation == "right":  # its query counted as the model gets it: cut to --max_length
        (long,) = [plain[i] for i in range(len(plain)) if plain[i].anchor.text.startswith("long")]
        assert int(collator([long])["attention_mask"][0].sum()) == 64


def test_training_draws_whole_packs_in_ms_swifts_order(minilm_path, tmp_path):
    from mmembed.training.samplers import SwiftOrderSampler
    from mmembed.training.sft import build_trainer

    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = parse(minilm_path, data, tmp_path, "--max_length", "64", "--max_steps", "2")
    trainer = build_trainer(args)
    packed = trainer.train_dataset
    assert sorted(i for p in packed.packs for i in p) == list(range(len(ROWS)))  # every row in one pack
    assert max(packed.pack_tokens) <= 120 and len(packed.packs) < len(ROWS)
    loader = trainer.get_train_dataloader()
    order = list(SwiftOrderSampler(len(packed), shuffle=True, seed=args.seed))  # ms-swift's order of the packs
    taken = [order[i:i + 2] for i in range(0, len(order), 2)]
    seen = 0
    for batch, packs in zip(loader, taken):
        want = [i for p in packs for i in packed.packs[p]]
        collated = trainer.data_collator([packed.rows[i] for i in want])
        for key in ("input_ids", "attention_mask", "labels"):  # the batch of exactly these rows
            assert torch.equal(batch[key], collated[key])
        seen += 1
    assert seen == len(taken)
    losses = trainer.train().training_loss
    assert np.isfinite(losses)


@pytest.mark.parametrize("task", ["reranker", "generative_reranker"])
def test_a_reranker_trains_on_packs(minilm_path, tiny_model, tmp_path, task):
    """A classifier (MiniLM) and a generative reranker (the tiny Qwen3, its pairs also packed into
    one sequence under --attn_impl varlen) train on packs of rows."""
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    model = ["--model", minilm_path] if task == "reranker" else ["--model", tiny_model("qwen3"), "--attn_impl", "varlen"]
    data = write_jsonl(tmp_path / "rows.jsonl", [r for r in ROWS if r["rejected_response"]])
    args = parse_sft_args([*model, "--task_type", task, "--dataset", data, "--output_dir",
                           str(tmp_path / "out"), "--report_to", "none", "--dataloader_num_workers", "0",
                           "--per_device_train_batch_size", "1", "--packing", "true", "--packing_length", "200",
                           "--max_steps", "2", "--max_length", "128"])
    result = run_sft(args)
    assert result["last_checkpoint"] and np.isfinite(result["train_loss"])


@pytest.mark.parametrize("flags,message", [
    (["--streaming", "true", "--max_steps", "2"], "--streaming true reads them as training consumes them"),
    (["--interleave_prob", "1"], "--interleave_prob draws each row from a dataset by chance"),
    (["--batch_sampler", "no_duplicates"], "--batch_sampler no_duplicates draw rows one by one"),
    (["--multi_dataset_sampler", "round_robin"], "--multi_dataset_sampler round_robin"),
    (["--packing_strategy", "best"], "--packing_strategy must be one of binpack, sequential"),
    (["--packing_length", "0"], "--packing_length must be a positive number"),
])
def test_what_cannot_go_with_packing_is_refused(minilm_path, tmp_path, flags, message):
    with pytest.raises(UsageError, match=message):
        parse(minilm_path, "d.jsonl", tmp_path, *flags)


def test_a_packed_run_resumes_exactly(minilm_path, tmp_path):
    """The packs are the same in the resumed run (the same lengths), so it trains on the packs the
    uninterrupted run trained on from that step: the same final weights."""
    import glob
    import shutil

    from safetensors.torch import load_file

    from mmembed.training.sft import run_sft

    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    whole = tmp_path / "whole"
    flags = ["--max_length", "64", "--max_steps", "4", "--save_steps", "2", "--gradient_accumulation_steps", "1"]
    args = parse(minilm_path, data, tmp_path, *flags)
    args.output_dir = str(whole)
    run_sft(args)
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    args = parse(minilm_path, data, tmp_path, *flags, "--resume_from_checkpoint", str(resumed / "checkpoint-2"))
    args.output_dir = str(resumed)
    run_sft(args)
    (a,), (b,) = (glob.glob(str(d / "checkpoint-4" / "*.safetensors")) for d in (whole, resumed))
    want, got = load_file(a), load_file(b)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
