"""mmembed: fine-tune text and multimodal embedding models with contrastive losses.

A drop-in for ms-swift's ``swift sft --task_type embedding``: the same data, flags and
``INFONCE_*`` variables. See README.md and the pages under docs/.
"""

__version__ = "0.1.0"

__all__ = ["Embedder", "build_loss", "train", "__version__"]


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
