"""QLoRA's quantized base: ms-swift's ``--quant_method bnb --quant_bits 4|8`` as bitsandbytes
settings, and their record in ``mmembed.json``.

ms-swift 4.6 (``swift/arguments/base_args/quant_args.py``) builds transformers'
``BitsAndBytesConfig`` from ``--quant_bits`` (4: ``load_in_4bit``, 8: ``load_in_8bit``),
``--bnb_4bit_quant_type`` (default ``nf4``), ``--bnb_4bit_use_double_quant`` (default true),
``--bnb_4bit_compute_dtype`` (default: float32 for a float16 or float32 ``--torch_dtype``,
bfloat16 for bfloat16) and ``--bnb_4bit_quant_storage``, and keeps a multimodal model's vision
tower, aligner and ``lm_head`` unquantized (``llm_int8_skip_modules``). The same is done here,
with the template's ``[parts]`` naming the tower and aligner.

Only the base is quantized, and only while training: the LoRA adapter is saved in full
precision, and an export merges it into the original (unquantized) base weights, as
``swift export --merge_lora true`` does (the dequantized 4-bit weights would carry the
quantization error into the merged model).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

QUANT_METHODS = ("bnb",)
#: ms-swift's other methods (``--quant_method``), which mmembed does not offer
OTHER_QUANT_METHODS = ("hqq", "eetq", "quanto", "fp8")
QUANT_BITS = (4, 8)
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("float16", "bfloat16", "float32")
STORAGE_DTYPES = ("uint8", "float16", "bfloat16", "float32")
#: the bitsandbytes release whose CPU backend trains (tested with 0.50.2)
MIN_BITSANDBYTES = "0.50.2"


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How the frozen base is loaded: bitsandbytes ``bits`` (4 or 8) and, for 4 bits, the
    data type (``nf4`` / ``fp4``), double quantization, the compute dtype of the 4-bit
    matmuls and the storage dtype of the packed weights (None: bitsandbytes' uint8)."""

    bits: int
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "float32"
    storage: str | None = None

    def record(self) -> dict[str, Any]:
        """What ``mmembed.json`` holds under ``quantization``: ms-swift's flag names and values."""
        return {"quant_method": "bnb", "quant_bits": self.bits, "bnb_4bit_quant_type": self.quant_type,
                "bnb_4bit_use_double_quant": self.double_quant, "bnb_4bit_compute_dtype": self.compute_dtype,
                "bnb_4bit_quant_storage": self.storage}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Quantization | None:
        """The inverse of :meth:`record` (None for a folder trained without quantization)."""
        if not record or not record.get("quant_method"):
            return None
        return cls(bits=int(record["quant_bits"]), quant_type=record.get("bnb_4bit_quant_type") or "nf4",
                   double_quant=bool(record.get("bnb_4bit_use_double_quant", True)),
                   compute_dtype=record.get("bnb_4bit_compute_dtype") or "float32",
                   storage=record.get("bnb_4bit_quant_storage"))

    def same_weights(self, other: Quantization | None) -> bool:
        """Whether ``other`` quantizes the base to the same stored weights (the compute dtype
        changes only the arithmetic, not what the adapter was trained against)."""
        if other is None or other.bits != self.bits:
            return False
        return self.bits == 8 or (self.quant_type, self.double_quant) == (other.quant_type, other.double_quant)

    def describe(self) -> str:
        """The flags that give this quantization, as a user types them."""
        text = f"--quant_method bnb --quant_bits {self.bits}"
        if self.bits == 4:
            text += f" --bnb_4bit_quant_type {self.quant_type} --bnb_4bit_use_double_quant {str(self.double_quant).lower()}"
        return text

    def loading(self, parts: dict[str, tuple[str, ...]], device) -> dict[str, Any]:
        """``load_backbone``'s keywords that quantize the base as it loads, onto ``device``: the
        config, with a template's ``parts`` (:func:`unquantized_modules`) kept in full precision."""
        return {"quantization_config": self.config(unquantized_modules(parts)), "device_map": {"": device}}

    def config(self, skip_modules: list[str] | None = None):
        """transformers' ``BitsAndBytesConfig`` (``skip_modules``: module-name prefixes kept
        unquantized; None: transformers' own choice, the output embeddings)."""
        import torch
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=self.bits == 4,
            load_in_8bit=self.bits == 8,
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_quant_storage=getattr(torch, self.storage or "uint8"),
            llm_int8_skip_modules=skip_modules,
        )


def default_compute_dtype(torch_dtype: str | None) -> str:
    """ms-swift's ``--bnb_4bit_compute_dtype`` default for ``--torch_dtype``: bfloat16 for a
    bfloat16 base, float32 for float16 and float32 (and for ``auto`` or unset, which load
    float32 weights here unless the folder says otherwise)."""
    return "bfloat16" if torch_dtype == "bfloat16" else "float32"


def unquantized_modules(parts: dict[str, tuple[str, ...]]) -> list[str] | None:
    """The modules ms-swift keeps in full precision (``get_modules_to_not_convert``): a
    multimodal model's vision tower and aligner (the template's ``vit`` and ``aligner``
    parts) and ``lm_head``; None for a text model (transformers' default)."""
    kept = [*parts.get("vit", ()), *parts.get("aligner", ())]
    return sorted(set(kept)) + ["lm_head"] if kept else None


def bitsandbytes_missing() -> str | None:
    """Why bitsandbytes cannot quantize here (not installed, or older than the release whose
    CPU backend trains), or None when it can."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"bitsandbytes is not installed: pip install 'bitsandbytes>={MIN_BITSANDBYTES}' (or 'mmembed[quant]')"
    from importlib.metadata import version

    from packaging.version import Version

    found = version("bitsandbytes")
    if Version(found) < Version(MIN_BITSANDBYTES):
        return f"bitsandbytes {found} is older than {MIN_BITSANDBYTES}: pip install -U 'bitsandbytes>={MIN_BITSANDBYTES}'"
    return None
