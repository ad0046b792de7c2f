"""The run's ``--output_dir`` for ``mmembed sft``: which checkpoint a run resumes from
(``--resume_from_checkpoint``, ``--resume_only_model``), what becomes of the checkpoints an
earlier run left there (continued, replaced with ``--overwrite_output_dir``, or refused),
and that the folder can be written before the model loads.

The checkpoints' own protocol (whole or absent, found by step) is :mod:`mmembed.training.checkpoints`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from ..files import WriteError
from ..model.weights import load_backbone_weights
from .arguments import SftArguments, UsageError
from .checkpoints import (
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    check_complete,
    clear_output_dir,
    find_last_complete_checkpoint,
    foreign_checkpoint,
    is_model_only,
    leftovers,
    list_checkpoints,
    not_a_checkpoint,
    saved_model,
    set_aside_later_checkpoints,
)
from .trainer import EmbeddingTrainer

logger = logging.getLogger("mmembed")


def resume_checkpoint(args: SftArguments) -> str | None:
    """``--resume_from_checkpoint``: a folder, or ``true``/``last`` for the newest complete one."""
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = find_last_complete_checkpoint(args.output_dir)
        if resume is None:
            raise FileNotFoundError(
                f"--resume_from_checkpoint true: no complete checkpoint under {args.output_dir} "
                "(start afresh with --overwrite_output_dir true)")
    elif isinstance(resume, str) and resume.lower() in ("false", "none", ""):
        resume = None
    if resume:
        if not os.path.isdir(resume):
            raise UsageError(f"--resume_from_checkpoint {resume}: no such folder (a checkpoint folder, or true for "
                             "the newest complete one in --output_dir)")
        if args.resume_only_model and (foreign_checkpoint(resume) or saved_model(resume)):
            # weights only: ms-swift's checkpoints, plain model / adapter folders and mmembed's
            # final models and exports load too (an mmembed checkpoint must still be whole: a
            # killed save's weights may be partial)
            return resume
        check_complete_once_per_node(resume, args)  # before the Trainer's own loaders (DeepSpeed's included) read it
        if is_model_only(resume):  # whole, but the model alone (--resume_only_model took it above)
            raise UsageError(f"--resume_from_checkpoint: {not_a_checkpoint(resume, saved_model(resume))}")
        check_same_quantization(args, resume)
    return resume


def check_same_quantization(args: SftArguments, resume: str) -> None:
    """A QLoRA checkpoint resumes on the base quantized as it was trained (``mmembed.json``'s
    ``quantization``), and a full-precision one on a full-precision base: the adapter and its
    optimizer state were fitted to those weights."""
    from ..model.io import read_mmembed_config
    from ..model.quantization import Quantization
    from .quant_flags import quantization

    saved = Quantization.from_record((read_mmembed_config(resume) or {}).get("quantization"))
    wanted = quantization(args)
    if saved is None and wanted is None or saved is not None and saved.same_weights(wanted):
        return
    was = saved.describe() if saved else "a full-precision base (no --quant_method)"
    raise UsageError(f"--resume_from_checkpoint {resume} was trained on {was}; resume it with the same quantization "
                     f"flags (got {wanted.describe() if wanted else 'no --quant_method'})")


def prepare_output_dir(args: SftArguments, resume: str | None) -> None:
    """A run into an ``--output_dir`` that holds checkpoints (or a killed save's leftovers)
    continues it (``--resume_from_checkpoint``), replaces them (``--overwrite_output_dir``:
    they are deleted now), or is refused, so a result is never confused with another run's."""
    with args.main_process_first(desc="checking --output_dir", local=args.save_on_each_node):
        check_writable(args.output_dir)  # every process writes into checkpoints (its RNG state)
        found = [path for _, path in list_checkpoints(args.output_dir)] + leftovers(args.output_dir)
        if resume and args.should_save:
            later, folder = set_aside_later_checkpoints(args.output_dir, resume, delete=args.overwrite_output_dir)
            if later:
                names = ", ".join(os.path.basename(p) for p in later)
                logger.warning("--resume_from_checkpoint %s goes back to an earlier step: the later checkpoints of the "
                               "run it leaves (%s) were %s, so that neither --resume_from_checkpoint true nor "
                               "--save_total_limit takes them for this run's", os.path.basename(resume), names,
                               f"moved to {folder}" if folder else "deleted (--overwrite_output_dir)")
        if not found or resume:
            return
        if not args.overwrite_output_dir:
            names = ", ".join(os.path.basename(p) for p in found[:4]) + (", ..." if len(found) > 4 else "")
            raise UsageError(
                f"--output_dir {args.output_dir} already holds checkpoints of another run ({names}); continue it with "
                "--resume_from_checkpoint true, replace them with --overwrite_output_dir true, or pick another --output_dir"
            )
        if args.should_save:
            removed = clear_output_dir(args.output_dir)
            logger.info("--overwrite_output_dir: deleted %d checkpoint folder(s) of an earlier run in %s", len(removed),
                        args.output_dir)


def check_writable(folder: str) -> None:
    """Create ``folder`` if needed and write a file in it now, so that a read-only or full
    ``--output_dir`` fails in one line before the model loads, not at the first checkpoint."""
    import tempfile

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"mmembed")
            f.flush()
    except OSError as e:
        raise WriteError(folder, e) from e


def resume_weights_only(trainer: EmbeddingTrainer, args: SftArguments, resume: str) -> str | None:
    """ms-swift's ``--resume_only_model``: the checkpoint's weights, a fresh optimizer, learning
    rate schedule and RNG; the step count and the data position continue from the checkpoint's
    ``trainer_state.json`` (batches already trained are skipped) unless ``--ignore_data_skip
    true``, which starts at step 0. Returns what ``Trainer.train`` resumes from (None: afresh)."""
    load_backbone_weights(trainer.accelerator.unwrap_model(trainer.model).backbone, resume)
    state = os.path.join(resume, "trainer_state.json")
    if args.ignore_data_skip or not os.path.isfile(state):
        why = "--ignore_data_skip true" if args.ignore_data_skip else "it has no trainer_state.json"
        logger.info("--resume_only_model: weights from %s; step count, data position, optimizer, scheduler and RNG "
                    "start afresh (%s)", resume, why)
        return None
    with open(state, encoding="utf-8") as f:
        step = json.load(f).get("global_step", 0)
    logger.info("--resume_only_model: weights from %s; training goes on from step %d with the data that follows "
                "(--ignore_data_skip true starts at step 0); optimizer, scheduler and RNG start afresh", resume, step)
    trainer.weights_only_resume = True
    return resume


def training_facts(args: SftArguments, loss: Any, data: Any) -> dict[str, Any]:
    """What the model card reports beside the model: the loss's settings, the data files with
    their row counts, the main hyperparameters and when training started."""
    settings = " ".join(repr(loss).split())  # the loss's repr names its settings (and an inner loss's)
    return {
        "loss_settings": settings,
        "data": {
            **{kind: [{"file": f, "rows": n} for f, n in records.items()] for kind, records in data.files.items()},
            "train_rows": len(data.train) if hasattr(data.train, "__len__") else None,  # a stream: unknown
            "val_rows": len(data.val) if data.val is not None else None,
            **({"datasets": [{"name": d.name, "weight": d.weight, "rows": d.rows, "val_rows": d.val_rows}
                             for d in data.datasets]} if args.dataset_config else {}),
        },
        "learning_rate": args.learning_rate,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "num_train_epochs": args.num_train_epochs if not args.max_steps or args.max_steps < 0 else None,
        "max_steps": args.max_steps if args.max_steps and args.max_steps > 0 else None,
        "seed": args.seed,
        "started_at": time.time(),
    }


def check_complete_once_per_node(checkpoint: str, args: SftArguments) -> None:
    """:func:`~mmembed.training.checkpoints.check_complete` (every file's sha256 against the
    manifest: the checkpoint read whole) by one process per node, the node's first, while the
    others wait; each then raises the same error when it failed, or goes on. One process, or no
    process group: checked here."""
    import torch.distributed as dist

    if args.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        check_complete(checkpoint)
        return
    failure = None
    if args.local_process_index == 0:
        try:
            check_complete(checkpoint)
        except BaseException as e:  # noqa: BLE001 (the others must learn of any failure, then it is raised)
            failure = e
    kinds = (UnsafeCheckpointError, IncompleteCheckpointError, OSError)
    kind = next((k.__name__ for k in kinds if isinstance(failure, k)), "Exception")
    status: list = [None] * dist.get_world_size()
    dist.all_gather_object(status, None if failure is None else (kind, str(failure)))
    if failure is not None:
        raise failure
    failed = next((s for s in status if s is not None), None)
    if failed is not None:
        kind, message = failed
        raise next((k for k in kinds if k.__name__ == kind), RuntimeError)(message)
