"""bench_gpu.py's parts (the command and its documentation: benchmarks/bench_gpu.py).

In the order a run goes through them:

- ``specs``: the recipes, model shapes, targets, sizes (GPU or ``--dry_run``), the flags, variants;
- ``models``: the model folders (built in a child) and the rows, in both forms;
- ``run``: the parent, one child per run and part, ``--save`` after each;
- ``child``: a side run in a child process (timed steps, batch waits), the versions of each python;
- ``st_side`` / ``swift_side``: sentence-transformers' side; mmembed's and ms-swift's (shared flags);
- ``measure``: model FLOPs, a batch's tokens and digest, what a step keeps for backward;
- ``largest``: ``--largest_batch``'s search;
- ``tables``: the printed table, targets and the reports after it;
- ``dry_run``: the same-work checks (first batch, first loss) and the meta-device checks;
- ``cli``: the command line (and ``--child``'s jobs).

Profiling one step by region and by memory is benchmarks/profile_step.py's and memory_step.py's.
"""
