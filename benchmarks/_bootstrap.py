"""Makes ``benchmarks`` importable where a command runs as a file (``python benchmarks/bench_gpu.py``).

Python then puts the command's folder, benchmarks/, first on ``sys.path``, not the checkout, so
``import benchmarks.gpu`` would fail. A command opens with::

    if not __package__:  # run as a file: the package registered from its folder (_bootstrap.py)
        import _bootstrap  # noqa: F401

which loads benchmarks/__init__.py by its path as the package ``benchmarks`` (its submodules are
then found in its folder, as for any package), and leaves ``sys.path`` as it was. Under
``python -m benchmarks.X`` (or an import of ``benchmarks.X``) ``__package__`` is set and this
module is not imported.
"""

import importlib.util
import os
import sys

if "benchmarks" not in sys.modules:
    _folder = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location("benchmarks", os.path.join(_folder, "__init__.py"),
                                                   submodule_search_locations=[_folder])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["benchmarks"] = _package
    _spec.loader.exec_module(_package)
