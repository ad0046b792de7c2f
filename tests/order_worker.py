"""Worker for tests/tools/test_swift_compat.py, run under torchrun: builds mmembed's trainer
with ms-swift's flags and writes the row ids of every step this process's training dataloader
gives (the dataloader transformers' training loop iterates, accelerate's wrapping included)."""

import argparse
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmembed.training.arguments import SftArguments  # noqa: E402
from mmembed.training.sft import build_trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--flags", required=True, help="SftArguments keywords as JSON")
    a = p.parse_args()
    args = SftArguments(model=a.model, output_dir=os.path.join(os.path.dirname(a.out), "run"),
                        per_device_train_batch_size=2, gradient_accumulation_steps=1, report_to=[],
                        **json.loads(a.flags))
    trainer = build_trainer(args)
    trainer.data_collator = lambda samples: [int(s.anchor.text.split(":", 1)[0].removeprefix("id ")) for s in samples]
    loader = trainer.get_train_dataloader()
    steps = []
    if args.streaming:  # one pass over the stream
        steps = [list(batch) for batch in loader]
    for epoch in range(0 if args.streaming else int(args.num_train_epochs)):
        loader.set_epoch(epoch)  # as transformers' training loop does, then reaching the batch sampler
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        steps += [list(batch) for batch in loader]
    with open(f"{a.out}.{dist.get_rank()}", "w") as f:
        json.dump(steps, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
