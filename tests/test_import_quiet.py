"""A user's script that imports mmembed and then sentence-transformers prints nothing of
bitsandbytes' (the dev and quant extras install it; peft, which sentence-transformers imports,
imports it): its one line on a missing optional ``kernels`` package, logged at import on a CPU
with AVX512-BF16, is dropped by mmembed/__init__.py, and only that line."""

import os
import subprocess
import sys

from conftest import REPO

from mmembed import BITSANDBYTES_KERNELS_HINT

LOGGER = "bitsandbytes.backends.cpu.ops"


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_importing_mmembed_then_sentence_transformers_prints_no_bitsandbytes_line():
    alone = _python("import sentence_transformers")
    both = _python("import mmembed, sentence_transformers")
    assert alone.returncode == both.returncode == 0, alone.stderr[-2000:] + both.stderr[-2000:]
    assert BITSANDBYTES_KERNELS_HINT not in both.stderr, both.stderr
    # where bitsandbytes says it at all (a CPU with AVX512-BF16, no kernels package: this project's
    # machines), the rest of the output is the same without it
    if BITSANDBYTES_KERNELS_HINT in alone.stderr:
        rest = [line for line in alone.stderr.splitlines() if BITSANDBYTES_KERNELS_HINT not in line]
        assert both.stderr.splitlines() == rest


def test_only_that_line_of_bitsandbytes_logger_is_dropped():
    """The same records on any machine: the hint (as bitsandbytes formats it) is dropped once
    mmembed is imported, another warning of that logger passes, and before the import the hint
    passes too (nothing else drops it)."""
    hint = BITSANDBYTES_KERNELS_HINT + ": %s. Please make sure you already `pip install kernels`"
    code = (f"import logging; log = logging.getLogger({LOGGER!r})\n"
            f"log.warning({hint!r}, 'before')\n"
            "import mmembed\n"
            f"log.warning({hint!r}, 'after')\n"
            "log.warning('another warning of bitsandbytes')\n")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"{BITSANDBYTES_KERNELS_HINT}: before. Please make sure you already `pip install kernels`",
                     "another warning of bitsandbytes"]
