"""mmembed: fine-tune text and multimodal embedding models with contrastive losses.

A drop-in for ms-swift's ``swift sft --task_type embedding``: the same data, flags and
``INFONCE_*`` variables. See README.md and the pages under docs/.
"""

import logging as _logging

__version__ = "0.1.0"

__all__ = ["Embedder", "build_loss", "train", "__version__"]

#: the line bitsandbytes (>= 0.50, imported by peft, hence by sentence-transformers, wherever it is
#: installed) logs at its import on a CPU with AVX512-BF16 when the optional ``kernels`` package is
#: missing: its plain-torch path runs instead, in every process, whether or not anything is
#: quantized. Dropped here, once mmembed is imported, this line only (the logger's other records pass).
BITSANDBYTES_KERNELS_HINT = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_the_kernels_hint(record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith(BITSANDBYTES_KERNELS_HINT)


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_kernels_hint)


def __getattr__(name):  # keep `import mmembed` light: torch/transformers load on first use
    if name == "Embedder":
        from .model.embedder import Embedder

        return Embedder
    if name == "train":  # the function; the package of the training code is mmembed.training
        from .tools.api import train

        return train
    if name == "build_loss":
        from .losses import build_loss

        return build_loss
    raise AttributeError(f"module 'mmembed' has no attribute {name!r}")
