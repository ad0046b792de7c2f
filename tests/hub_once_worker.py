"""Worker for tests/training/test_hub_models.py, run as several processes of one node: builds
``mmembed sft``'s arguments (which start the process group), resolves the model flags as a
run does (:func:`mmembed.training.hub_models.resolve_model_flags`), and writes the folder
``--model`` became, or the error, to ``OUT.RANK``, with the hub markers in the temporary folder
after the resolution and after the end of a run under several processes (``mmembed.train``'s)."""

import argparse
import glob
import json
import os
import sys
import tempfile

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmembed.errors import UsageError  # noqa: E402
from mmembed.tools.api import _after_the_run  # noqa: E402
from mmembed.training.arguments import SftArguments  # noqa: E402
from mmembed.training.hub_models import resolve_model_flags  # noqa: E402


def _markers() -> list[str]:
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), "mmembed-hub-*")))


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
    if dist.is_initialized():
        result["markers"] = [os.path.basename(m) for m in _markers()]
        _after_the_run()  # as mmembed.train's end (mmembed sft's exit likewise): a barrier, then the removal
        dist.barrier()
        result["markers_after"] = [os.path.basename(m) for m in _markers()]
    with open(f"{a.out}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
