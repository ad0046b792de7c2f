"""What the device and the launch change in ``mmembed sft``'s flags: the defaults a GPU
brings (:func:`device_defaults`: bf16, workers, pinning, FlashAttention / liger-kernel where
installed), the gradient accumulation that makes ms-swift's global batch of 16, the
optimizer kept under DeepSpeed's CPU offload, and the variables a one-process DeepSpeed run
needs. :class:`~mmembed.training.arguments.SftArguments` applies them to its flags
(:class:`~mmembed.training.sft_flags.SftFlags`) after their values are checked
(:mod:`mmembed.training.flag_checks`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING

from ..environment import export
from ..environment import read as read_environment
from .flag_checks import check_prefetch, read_deepspeed_json
from .sft_flags import SftFlags

if TYPE_CHECKING:
    from ..encoding.templates import Template


def honour_optimizer_under_offload(deepspeed, optim: str):
    """With the optimizer offloaded to the CPU, DeepSpeed replaces the chosen optimizer by its
    own CPU Adam. That is the same algorithm for AdamW (and faster), so it stays; for any
    other ``--optim`` the config is told to keep the chosen one."""

    if not deepspeed or optim.startswith("adamw"):
        return deepspeed
    config = read_deepspeed_json(deepspeed) if isinstance(deepspeed, str) else deepspeed
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device") not in ("cpu", "nvme") or "zero_force_ds_cpu_optimizer" in config:
        return deepspeed
    return {**config, "zero_force_ds_cpu_optimizer": False}


def skip_cpu_shared_memory_op() -> None:
    """On a machine without an accelerator, DeepSpeed's process group builds its shared-memory
    all-reduce op (``deepspeed_shm_comm``, a C++ extension compiled on first use: one to three
    minutes on 2 cores) when it starts. The op serves only DeepSpeed's inference all-reduce,
    which training never calls (ZeRO's collectives go through torch.distributed, gloo here), so
    it is marked unavailable and DeepSpeed falls back to gloo without compiling anything."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def one_process_group_env() -> bool:
    """A single process under DeepSpeed (no torchrun) gets the variables torchrun would give
    it (rank 0 of 1, a free local port). Without them DeepSpeed looks for an MPI launcher and
    fails with "No module named 'mpi4py'"; ms-swift starts torchrun even for one process.
    Returns whether anything was set; a process started by a launcher is left alone."""
    if read_environment().launch.in_process_group:
        return False
    import socket

    with socket.socket() as s:  # the port is picked here and bound by the process group moments later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    export({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
           defaults={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return True


def device_defaults(args: SftFlags, cuda: bool) -> list[str]:
    """Fill the flags left unset whose best value depends on the device, and return them as
    ``--flag value`` for the log. What helps on a few CPU cores does not on a GPU: there the
    padding cut by length chunks costs more in host syncs, launches and new shapes than it
    saves, data preparation must overlap the GPU's work, and bf16 is ms-swift's default.

    - ``--torch_dtype``: float32 on a CPU. On a GPU, LoRA loads the frozen base in half
      precision (the model's float16, else bfloat16, as ms-swift); full training keeps
      float32 weights. Both then compute under ``--bf16`` autocast (``--fp16`` without bf16).
    - ``--length_chunks``: 4 on a CPU, 1 on a GPU; ``--length_buckets``: on a GPU only.
    - ``--dataloader_num_workers``: 0 on a CPU (no spare core); on a GPU up to 4, leaving
      one core per process to the trainer, with ``--dataloader_persistent_workers`` and a
      prefetch of 4 batches.
    """
    chosen: list[str] = []

    def choose(flag: str, value) -> None:
        setattr(args, flag, value)
        chosen.append(f"--{flag} {str(value).lower() if isinstance(value, bool) else value}")

    if args.length_chunks is None:
        choose("length_chunks", 1 if cuda else 4)
    if args.length_buckets is None:
        choose("length_buckets", cuda)
    if args.dataloader_num_workers is None:
        workers = 0
        if cuda:
            local = read_environment().launch.local_processes
            workers = max(0, min(4, (os.cpu_count() or 1) // max(local, 1) - 1))
        choose("dataloader_num_workers", workers)
        if workers and args.dataloader_prefetch_factor is None:
            choose("dataloader_prefetch_factor", 4)
        if workers and not args.dataloader_persistent_workers:
            choose("dataloader_persistent_workers", True)
        check_prefetch(args)
    if cuda and args.torch_dtype is None and (args.tuner_type != "lora" or os.path.isdir(args.model or "")):
        # LoRA: the frozen base in the model's half precision (ms-swift's default); full
        # training keeps float32 master weights under bf16 autocast, since AdamW steps of a
        # small learning rate round away in bfloat16 weights (ms-swift trains them in bf16).
        # A hub id's dtype is chosen once it is downloaded (dtype_after_download).
        choose("torch_dtype", gpu_dtype(args.model) if args.tuner_type == "lora" else "float32")
    if cuda and not (args.bf16 or args.fp16) and args.torch_dtype in ("bfloat16", "float32", None):
        import torch

        if torch.cuda.is_bf16_supported():
            choose("bf16", True)
        elif args.torch_dtype == "float32":
            choose("fp16", True)
    return chosen


def dtype_after_download(args, cuda: bool) -> list[str]:
    """The ``--torch_dtype`` default :func:`device_defaults` leaves to after a hub id's download
    (LoRA on a GPU: the half precision of the model's ``config.json``), as it names it; the
    autocast (``--bf16``) was chosen with the flags, as for a model saved in bfloat16."""
    if not (cuda and args.torch_dtype is None and args.tuner_type == "lora"):
        return []
    args.torch_dtype = gpu_dtype(args.model)
    return [f"--torch_dtype {args.torch_dtype}"]


def training_padding(template: Template, padding_flag: str | None, cuda: bool) -> Template:
    """The template the training collator pads with: on a GPU, a template that pads on the left
    (qwen3_emb, gte_qwen2) pads training batches on the right unless ``--padding_side`` says
    otherwise. A left-padded row's pad positions come before every real token, so under causal
    attention their queries have no key at all; PyTorch's cuDNN attention, which SDPA picks on
    Hopper GPUs for widths that are multiples of 16 (the bucketed widths), returns NaN gradients
    for such rows (measured on an H200, torch 2.11: benchmarks/sdpa_padding_check.py). The
    embeddings and gradients are the same on both sides (the last token is found by the mask,
    rotary positions are relative), so the saved model keeps the template's side."""
    if cuda and padding_flag is None and template.padding_side == "left":
        import logging

        logging.getLogger("mmembed").info(
            "padding training batches on the right (template %s pads on the left, which gives NaN gradients with "
            "cuDNN attention on a GPU; the embeddings are the same, and --padding_side left keeps the left)",
            template.name)
        return dataclasses.replace(template, padding_side="right")
    return template


def gpu_dtype(model_dir: str | None) -> str:
    """ms-swift's default dtype on a GPU: the half precision the model was saved in, else
    bfloat16 (float16 where the GPU has no bfloat16)."""

    import torch

    try:
        with open(os.path.join(model_dir or "", "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    saved = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if saved == "float16" or not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"


def default_gradient_accumulation(per_device_batch: int, world_size: int) -> int:
    """ms-swift's default: accumulate up to a global batch of 16 rows."""
    return max(1, math.ceil(16 / per_device_batch / world_size))


def import_deepspeed_only_when_used() -> None:
    """accelerate's ``extract_model_from_parallel`` (every ``unwrap_model``, so every Trainer)
    imports DeepSpeed whenever it is installed, to test whether the model is a
    ``DeepSpeedEngine``; importing DeepSpeed on a machine without an accelerator prints "Setting
    accelerator to CPU" on every command. No model can be a DeepSpeedEngine before DeepSpeed is
    imported, so accelerate's test is answered "no DeepSpeed" until a run that uses it (which
    imports it when its engine starts) has: the same answers, no import and no line otherwise.
    A later accelerate without the function is left as it is."""
    import sys

    from accelerate.utils import other

    available = getattr(other, "is_deepspeed_available", None)
    if available is None or getattr(available, "_mmembed_lazy", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and available()

    is_deepspeed_available._mmembed_lazy = True
    other.is_deepspeed_available = is_deepspeed_available
