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


def _forked_processes() -> int:
    """How many processes to fork in place of mmembed's relaunch (cli._maybe_relaunch's reading of
    the launch variables); 0: leave the command to mmembed (one process, already launched, several
    nodes, a malformed variable it reports itself, or MMEMBED_TEST_TORCHRUN=1)."""
    from mmembed.environment import read

    launch = read().launch
    try:
        nproc, nnodes = launch.integer("NPROC_PER_NODE", 1, 1), launch.integer("NNODES", 1, 1)
    except ValueError:
        return 0
    if os.environ.get("MMEMBED_TEST_TORCHRUN") or launch.launched or nnodes > 1 or nproc <= 1:
        return 0
    return nproc


def main() -> int:
    argv = sys.argv[1:]
    nproc = _forked_processes()
    if not nproc:
        from mmembed.tools.cli import main as mmembed

        return mmembed(argv)
    sys.path.insert(0, TESTS)
    from forked_cli import run_ranks

    result = run_ranks(["-m", "mmembed", *argv], nproc, timeout=3600, cwd=os.getcwd())
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # waited for: no server left behind, and its CPU time is this process's children's
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
