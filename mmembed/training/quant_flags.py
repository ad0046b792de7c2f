"""``--quant_method bnb --quant_bits 4|8`` (QLoRA) and the ``--bnb_4bit_*`` flags, checked when
the arguments are made, so that what cannot work is one line before the model loads; and the
:class:`~mmembed.model.quantization.Quantization` they give the model loader."""

from __future__ import annotations

import logging

from ..errors import UsageError
from ..model.quantization import (
    COMPUTE_DTYPES,
    OTHER_QUANT_METHODS,
    QUANT_BITS,
    QUANT_METHODS,
    QUANT_TYPES,
    STORAGE_DTYPES,
    Quantization,
    bitsandbytes_missing,
    default_compute_dtype,
)
from ..task import get_task
from .flag_checks import DEEPSPEED_CONFIGS, bundled_deepspeed_config, read_deepspeed_json
from .sft_flags import SftFlags

logger = logging.getLogger("mmembed")

_BNB_DEFAULTS = {"bnb_4bit_compute_dtype": None, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                 "bnb_4bit_quant_storage": None}


def check_quantization(args: SftFlags) -> None:
    """The quantization flags as ms-swift takes them, and what refuses them here: another
    method than bnb, bits other than 4 or 8, full training (quantized weights take no
    optimizer step), a reranker task, DeepSpeed ZeRO-3 (its partitioning of the packed
    4-bit weights is not supported here), or bitsandbytes missing."""
    method = (args.quant_method or "").strip().lower() or None
    if method in ("none", "null"):
        method = None
    args.quant_method = method
    if method is None:
        if args.quant_bits is not None:
            raise UsageError(f"--quant_bits {args.quant_bits} needs --quant_method bnb")
        given = [f"--{k}" for k, v in _BNB_DEFAULTS.items() if getattr(args, k) != v]
        if given:
            logger.info("%s has no effect without --quant_method bnb", ", ".join(given))
        return
    if method in OTHER_QUANT_METHODS:
        raise UsageError(f"--quant_method {method} is not supported: mmembed quantizes with bitsandbytes "
                         "(--quant_method bnb --quant_bits 4)")
    if method not in QUANT_METHODS:
        raise UsageError(f"--quant_method must be bnb, got {method!r}")
    if args.quant_bits is None:
        raise UsageError("--quant_method bnb needs --quant_bits 4 (QLoRA) or 8")
    if args.quant_bits not in QUANT_BITS:
        raise UsageError(f"--quant_bits {args.quant_bits}: bitsandbytes quantizes to 4 or 8 bits")
    for flag, allowed in (("bnb_4bit_quant_type", QUANT_TYPES), ("bnb_4bit_compute_dtype", COMPUTE_DTYPES),
                          ("bnb_4bit_quant_storage", STORAGE_DTYPES)):
        value = getattr(args, flag)
        if value is not None and value not in allowed:
            raise UsageError(f"--{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if args.tuner_type != "lora":
        raise UsageError(f"--quant_method bnb with --tuner_type {args.tuner_type}: quantized weights cannot be trained; "
                         "use --tuner_type lora (QLoRA: the LoRA adapter trains on the quantized frozen base)")
    if not get_task(args.task_type).quantizable:
        raise UsageError(f"--quant_method bnb with --task_type {args.task_type}: quantized training is offered for "
                         "embedding models; train this model in --torch_dtype bfloat16")
    stage = _zero_stage(args.deepspeed)
    if stage == 3:
        raise UsageError(f"--quant_method bnb with --deepspeed {args.deepspeed}: ZeRO-3 would build the quantized base "
                         "under its partitioning, which is not supported here; use --deepspeed zero2 or no DeepSpeed "
                         "(a QLoRA base is small enough to sit whole on each GPU)")
    missing = bitsandbytes_missing()
    if missing:
        raise UsageError(f"--quant_method bnb: {missing}")


def quantization(args: SftFlags) -> Quantization | None:
    """The quantization the flags ask for (None: a full-precision base), with ms-swift's
    compute-dtype default for ``--torch_dtype`` filled in."""
    if not args.quant_method:
        return None
    return Quantization(bits=int(args.quant_bits), quant_type=args.bnb_4bit_quant_type,
                        double_quant=bool(args.bnb_4bit_use_double_quant),
                        compute_dtype=args.bnb_4bit_compute_dtype or default_compute_dtype(args.torch_dtype),
                        storage=args.bnb_4bit_quant_storage)


def _zero_stage(deepspeed) -> int | None:
    """The ZeRO stage of ``--deepspeed`` as given (a bundled config's name, a JSON file, inline
    JSON or a dict); None without DeepSpeed or a stage."""
    if not deepspeed:
        return None
    if isinstance(deepspeed, str) and deepspeed in DEEPSPEED_CONFIGS:
        deepspeed = bundled_deepspeed_config(deepspeed)
    config = read_deepspeed_json(deepspeed) if isinstance(deepspeed, str) else deepspeed
    stage = (config.get("zero_optimization") or {}).get("stage")
    return int(stage) if isinstance(stage, int) else None
