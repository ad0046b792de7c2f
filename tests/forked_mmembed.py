"""``mmembed`` for a shell script under test (tests/tools/test_swift_scripts.py puts it first on
the script's PATH): ``NPROC_PER_NODE=N mmembed sft ...`` runs the N processes forked from a
server that imported torch, transformers, DeepSpeed and mmembed once
(:func:`forked_cli.run_ranks`, with the variables torchrun gives its workers) instead of
relaunching under torchrun, whose every worker imports them anew (~12 s of CPU each here: the
8 processes of ms-swift's train_gme.sh spent most of their time importing). Any other command,
and every command with ``MMEMBED_TEST_TORCHRUN=1``, is mmembed's own: its relaunch under
torchrun is tested as such in tests/training/test_distributed.py."""

import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    argv = sys.argv[1:]
    nproc = os.environ.get("NPROC_PER_NODE", "1")
    launched = "LOCAL_RANK" in os.environ or "RANK" in os.environ
    if os.environ.get("MMEMBED_TEST_TORCHRUN") or launched or not nproc.isdigit() or int(nproc) <= 1 \
            or os.environ.get("NNODES", "1") != "1":
        from mmembed.tools.cli import main as mmembed

        return mmembed(argv)
    sys.path.insert(0, TESTS)
    from forked_cli import run_ranks

    result = run_ranks(["-m", "mmembed", *argv], int(nproc), timeout=3600, cwd=os.getcwd())
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # waited for: no server left behind, and its CPU time is this process's children's
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
