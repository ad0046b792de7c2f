"""The files of the checkout that the benchmarks read, found from this folder.

The benchmarks run from a checkout of the repository, as its data does (``examples/data``). Two
Python files of it are read as files too, by their paths, never through an edit of ``sys.path``
and never imported as modules of tests/ or examples/:

- ``examples/tiny_models.py``: the one builder of the tiny offline Qwen folders (real tokenizer,
  random weights) that the examples, the suite and the docs use; copying it here would let the
  benchmarks' tiny models drift from the suite's, and it is no part of mmembed's library;
- ``tests/reference_losses.py``: the plain per-group InfoNCE the tests trust, the baseline
  bench_infonce.py checks mmembed's loss against.

Each is loaded once per process under its own module name (a process that imported it already,
such as the test suite, gets the same module back).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
DATA = os.path.join(EXAMPLES, "data")


def load_file(name: str, path: str) -> ModuleType:
    """The Python file ``path`` (relative to the checkout) as the module ``name``, loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def tiny_models() -> ModuleType:
    """examples/tiny_models.py: ``build(kind, out_dir, seed=0)``, ``build_qwen_tokenizer``,
    ``TOKENIZER_SPECS``, ``VOCAB_SIZE`` ..."""
    return load_file("tiny_models", os.path.join("examples", "tiny_models.py"))


def reference_losses() -> ModuleType:
    """tests/reference_losses.py: ``parse_groups``, ``reference_infonce`` ..."""
    return load_file("reference_losses", os.path.join("tests", "reference_losses.py"))
