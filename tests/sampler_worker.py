"""Worker for tests/training/test_multi_samplers.py, run under torchrun: trains with
``mmembed.training.sft.run_sft`` and writes, for this process, the row ids of every micro-batch
its collator was handed (in order), so the test can put each optimizer step's global batch
together from all processes.

The rows' texts start with ``<dataset> <row>:`` (one file per dataset). With
``--dataset_config`` the loading's dataset indices (``dataset_ids``) and names / weights
(``train_datasets``) are checked against those texts; without it they are set from them (a
stream, ``--streaming true``: neither, its rows are read as training goes)."""

import argparse
import json
import os
import sys
import types

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmembed.training.sft as sft  # noqa: E402
from mmembed.training.arguments import SftArguments  # noqa: E402


def row_id(sample) -> str:
    return sample.anchor.text.split(":", 1)[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--weights", required=True, help="JSON {dataset name: weight}, in dataset order")
    p.add_argument("--flags", required=True, help="SftArguments keywords as JSON")
    a = p.parse_args()
    weights = json.loads(a.weights)
    names = list(weights)
    seen: list[list[str]] = []
    build = sft.build_trainer

    def hooked(args, media=None):
        trainer = build(args, media)
        dataset = trainer.train_dataset
        if args.streaming:  # a stream: its rows are met as they are read (the test checks the batches)
            ids = None
        else:
            ids = [names.index(row_id(dataset[i]).split()[0]) for i in range(len(dataset))]
        if ids is None:
            pass
        elif args.dataset_config:  # the loading's own ids, names and weights: they must be these
            assert np.array_equal(np.asarray(dataset.dataset_ids), ids)
            assert [(d.name, d.weight, d.rows) for d in trainer.train_datasets] == [
                (n, w, ids.count(k)) for k, (n, w) in enumerate(weights.items())]
        else:
            dataset.dataset_ids = np.array(ids)
            trainer.train_datasets = [types.SimpleNamespace(name=n, weight=w, rows=ids.count(d))
                                      for d, (n, w) in enumerate(weights.items())]
        collate = trainer.data_collator

        def recording(samples):
            seen.append([row_id(s) for s in samples])
            return collate(samples)

        trainer.data_collator = recording
        return trainer

    sft.build_trainer = hooked
    sft.run_sft(SftArguments(**json.loads(a.flags)))
    with open(f"{a.out}.{dist.get_rank()}", "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
