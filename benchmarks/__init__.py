"""mmembed's benchmarks, a package apart from the library (as open_clip keeps its training script).

Each ``bench_*.py`` / ``learn_*.py`` here is a command of its own, run from a checkout either way:

    python benchmarks/bench_gpu.py --dry_run
    python -m benchmarks.bench_gpu --dry_run

They use mmembed as an installed package and the helpers of this package: ``checkout`` (the
checkout's files the benchmarks read: examples/data, the tiny models of examples/tiny_models.py,
the reference losses of tests/reference_losses.py, each loaded by its path), ``gpu/`` (the parts of
bench_gpu.py), ``profile_step`` and ``memory_step`` (one step measured by region and by memory).
Run as a file, a command's folder is ``sys.path[0]`` and the package is not importable by name:
``_bootstrap`` registers it from its folder, with no edit of ``sys.path``. tests/test_layout.py
checks that no file here is over 600 lines, edits ``sys.path`` or imports from tests/ or examples/.
"""
