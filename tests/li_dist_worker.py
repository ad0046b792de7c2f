"""``mmembed sft ARGS`` in one process of a multi-process run (tests/tasks/test_late_interaction_distributed.py),
with the gradient of the gathered batch kept on this process only: each process's rows get back
the gradient of its own loss term, not the sum over processes, so negatives held by another process
carry no gradient home. The test's control: that run must not equal one process on the global batch.

Usage: ``python tests/li_dist_worker.py SFT ARGS...`` (under torchrun, or forked with its variables).
"""

import sys

import mmembed.training.distributed as distributed
from mmembed.tools.cli import main


def _local_backward(ctx, grad):
    start = sum(ctx.sizes[: ctx.rank])
    return grad[start : start + ctx.sizes[ctx.rank]], None, None  # no all-reduce across processes


if __name__ == "__main__":
    distributed._AllGatherWithGrad.backward = staticmethod(_local_backward)
    sys.exit(main(["sft", *sys.argv[1:]]))
