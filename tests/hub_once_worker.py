"""Worker for tests/training/test_hub_models.py, run as several processes of one node: builds
``mmembed sft``'s arguments (which start the process group), resolves the model flags as a
run does (:func:`mmembed.training.hub_models.resolve_model_flags`), and writes the folder
``--model`` became, or the error, to ``OUT.RANK``."""

import argparse
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmembed.errors import UsageError  # noqa: E402
from mmembed.training.arguments import SftArguments  # noqa: E402
from mmembed.training.hub_models import resolve_model_flags  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--flags", required=True, help="SftArguments keywords as JSON")
    a = p.parse_args()
    args = SftArguments(report_to=[], **json.loads(a.flags))
    try:
        resolve_model_flags(args)
        result = {"model": args.model}
    except UsageError as e:
        result = {"error": str(e)}
    with open(f"{a.out}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
