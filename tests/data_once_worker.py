"""Worker for tests/data/test_scale.py, run under torchrun (or alone): builds mmembed's trainer
as ``mmembed sft`` does, with every process logging at INFO under its rank, and writes the
training rows (file, line) this process would train on, in order."""

import argparse
import json
import logging
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmembed.training.arguments import SftArguments  # noqa: E402
from mmembed.training.sft import build_trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--flags", required=True, help="SftArguments keywords as JSON")
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(name)s: %(message)s", force=True)
    logging.getLogger("mmembed").setLevel(logging.INFO)
    args = SftArguments(report_to=[], **json.loads(a.flags))
    trainer = build_trainer(args)
    rows = [[s.source, s.line] for s in trainer.train_dataset]
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump(rows, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
