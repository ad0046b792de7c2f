"""Checkpoints that are whole or absent, whatever is killed when.

A checkpoint ``output_dir/checkpoint-N`` is written in this order:

1. every process writes into a staging folder ``output_dir/.partial-checkpoint-N`` (the
   weights, tokenizer, ``mmembed.json``, ``training_args.bin``, optimizer / scheduler / RNG
   state, DeepSpeed's engine state, ``trainer_state.json``);
2. all processes agree that every write succeeded (a failure on any process removes the
   staging folder on all of them and raises :class:`CheckpointWriteError`);
3. the saving process flushes every file to disk, writes the marker ``mmembed_complete``
   (a JSON manifest: the step, every file with its size, and every file's sha256), flushes it, and renames the
   staging folder to ``checkpoint-N`` (an older folder of that name is unmarked and moved
   aside first);
4. only then are old checkpoints rotated out (``--save_total_limit``), each one unmarked
   (marker removed and flushed) before its files are deleted.

So a folder named ``checkpoint-N`` with a marker always holds every file its manifest lists;
resuming takes the newest such folder (:func:`find_last_complete_checkpoint`), and anything
else (a staging folder, an unmarked folder) is never trusted.

The hashes: every file ``torch.save`` writes into the staging folder (the optimizer,
scheduler, scaler and RNG state, ``training_args.bin``, DeepSpeed's engine files: the bulk of
a checkpoint) is hashed on its way out (:func:`hashed_torch_saves`), each process hashing what
it wrote; safetensors writes its files from native code by path, so those, and the small JSON
files, are read back once, from the page cache, by the same pass that flushes them
(:func:`~mmembed.files.sync_tree`), before the marker is written. A resume compares
them (:func:`check_complete`) and refuses a file changed since (its name in one line). The
files are then loaded with ``torch.load(weights_only=True)`` (:func:`load_untrusted`; DeepSpeed's
engine files too, with the few DeepSpeed types they hold allowed), so even a checkpoint whose
manifest was rewritten runs no code. Manifests from before hashes (sizes only) still load.

``MMEMBED_TEST_KILL_AT=POINT:N`` (test-only) kills the process with SIGKILL the N-th time it
reaches the named point of saving or rotation (:data:`TEST_POINTS`);
``MMEMBED_TEST_FULL_AT=POINT:N`` (test-only) instead makes every later file write fail as on
a full disk (``RLIMIT_FSIZE`` 0, SIGXFSZ ignored, so writes get EFBIG from the kernel);
``MMEMBED_TEST_PAUSE_AT=POINT:N[,POINT:N...]`` (test-only) pauses the process there: it creates
the file ``MMEMBED_TEST_PAUSE_FILE`` (``.rankR`` appended under torchrun), holding the point's name
and the process id, and waits (up to 10 minutes) until the test removes it, so a test can send a
signal at a known point (:mod:`mmembed.training.preemption`; besides the points
above, ``train:step`` is reached at the start of every optimizer step). The hooks are read once,
where a run starts (:func:`mmembed.training.hooks.arm_test_hooks`, from :func:`mmembed.training.sft.run_sft`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time

from ..files import HashingWriter, WriteError, sync_folder, sync_tree
from .hooks import test_point

COMPLETE_MARKER = "mmembed_complete"
STAGING_PREFIX = ".partial-"
_TRASH_PREFIX = ".deleting-"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")

# where the test hooks can stop a save (in this order) or a rotation
TEST_POINTS = ("save:begin", "save:model", "save:written", "save:marked", "save:renamed",
               "rotate:unmarked", "rotate:deleting", "rotate:done")


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written; nothing was left under its name and the older
    checkpoints are untouched."""


class IncompleteCheckpointError(ValueError):
    pass


class UnsafeCheckpointError(IncompleteCheckpointError):
    """A file of a checkpoint was changed since it was saved (its content hash no longer
    matches the manifest), or holds something other than tensors and plain data (a pickled
    object that loading would construct or call): the checkpoint is refused, naming the file,
    and nothing in it is run."""


#: The types DeepSpeed writes into its engine files (``global_stepN/*.pt``) beside tensors and
#: plain containers, read from real ZeRO-2 and ZeRO-3 checkpoints with and without optimizer
#: offload (``torch.serialization.get_unsafe_globals_in_checkpoint``; tests/training/
#: test_deepspeed_resume.py checks it): the ZeRO optimizer's loss scaler, its stage enum and the
#: fragment addresses of its partitions, plain data once loaded.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")

# the files of a checkpoint a resume unpickles: the Trainer's state and DeepSpeed's engine files
_PICKLED = re.compile(r"(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|global_step\d+/[^/]+\.pt)")


def resolve_globals(names: tuple[str, ...]) -> tuple[type, ...]:
    """The classes named ``module.Name`` (those whose module is installed)."""
    import importlib

    found = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def load_untrusted(path: str, map_location=None, allowed: tuple[type, ...] = ()):
    """``torch.load(path, weights_only=True)``: tensors, plain containers and numbers, and
    exactly the types in ``allowed`` beside those (torch's own unpickler calls or builds
    nothing else). A file that needs anything else is refused by name with
    :class:`UnsafeCheckpointError`, and nothing of it is run."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(refused_file(path, e)) from None


def check_unpicklable(checkpoint: str) -> None:
    """Before anything loads, on every process alike: each file of ``checkpoint`` that a resume
    unpickles (optimizer, scheduler, scaler, RNG state, DeepSpeed's engine files) needs no type
    beyond torch's weights-only set (and, for DeepSpeed's files, :data:`DEEPSPEED_GLOBALS`);
    otherwise :class:`UnsafeCheckpointError` names the file and the type. The pickles are read
    without being run (torch's static scan); a file in torch's older, non-zip format is loaded
    weights-only instead. The loads themselves are weights-only too (:func:`load_untrusted`)."""
    import torch
    from transformers.trainer_pt_utils import safe_globals as numpy_globals

    for folder, _, names in os.walk(checkpoint):
        for name in sorted(names):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, checkpoint).replace(os.sep, "/")
            if not _PICKLED.fullmatch(rel):
                continue
            # what the loader allows: DeepSpeed's types for its files, numpy's for the RNG state
            # (as the Trainer's _load_rng_state allows them), nothing more for the others
            if rel.startswith("global_step"):
                allowed = torch.serialization.safe_globals(list(resolve_globals(DEEPSPEED_GLOBALS)))
            else:
                allowed = numpy_globals() if name.startswith("rng_state") else contextlib.nullcontext()
            with allowed:
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
                except ValueError:  # not torch's zip format: a weights-only load is the check
                    load_untrusted(path, map_location="cpu")
                    continue
                except Exception as e:  # noqa: BLE001  (a damaged zip: torch's own error types vary)
                    raise UnsafeCheckpointError(f"{path}: refused: not a readable torch file "
                                                f"({' '.join(str(e).split())})") from None
            if unsafe:
                raise UnsafeCheckpointError(refused_file(path, f"Unsupported global: GLOBAL {unsafe[0]}"))


def refused_file(path, error: BaseException | str) -> str:
    """Why the file ``path`` of a checkpoint is refused, from torch's weights-only unpickling error."""
    text = " ".join(str(error).split())
    m = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", text)
    what = f"{m.group(1)}" if m else "data that is not tensors and plain values"
    return (f"{path}: refused: it needs {what}, which mmembed does not unpickle from a checkpoint (it could run "
            "code planted in the file); the checkpoint was changed or not written by mmembed: resume from another "
            "checkpoint")


def checkpoint_step(path: str) -> int | None:
    m = _CHECKPOINT.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def is_complete(checkpoint: str) -> bool:
    """Whether ``checkpoint`` carries the marker and every file its manifest lists, at the
    listed size (a marker from before manifests, holding only the step, counts as complete)."""
    marker = os.path.join(checkpoint, COMPLETE_MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    try:
        manifest = json.loads(text)
    except ValueError:
        return False
    if not isinstance(manifest, dict):
        return isinstance(manifest, int)  # the older marker: the step alone
    files = manifest.get("files", {})
    return all(os.path.getsize(os.path.join(checkpoint, name)) == size if os.path.isfile(os.path.join(checkpoint, name))
               else False for name, size in files.items())


def changed_files(checkpoint: str) -> list[str]:
    """The files of a whole ``checkpoint`` whose content no longer has the sha256 its manifest
    recorded when it was saved (every file is read once). A manifest from before content hashes
    (sizes only, no ``sha256``) has nothing to compare: none."""
    try:
        with open(os.path.join(checkpoint, COMPLETE_MARKER), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return []
    hashes = manifest.get("sha256", {}) if isinstance(manifest, dict) else {}
    return [name for name, digest in sorted(hashes.items()) if file_sha256(os.path.join(checkpoint, name)) != digest]


def file_sha256(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Every ``checkpoint-N`` folder under ``output_dir`` (complete or not), by step."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step = checkpoint_step(name)
        if step is not None and os.path.isdir(os.path.join(output_dir, name)):
            found.append((step, os.path.join(output_dir, name)))
    return sorted(found)


def leftovers(output_dir: str) -> list[str]:
    """Folders a killed save or rotation left behind (staging folders, folders being deleted)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(os.path.join(output_dir, n) for n in os.listdir(output_dir)
                  if n.startswith((STAGING_PREFIX, _TRASH_PREFIX)) and os.path.isdir(os.path.join(output_dir, n)))


def find_last_complete_checkpoint(output_dir: str) -> str | None:
    """The highest-numbered ``checkpoint-N`` under ``output_dir`` that is whole and that
    training can resume from (not the model alone that ``--save_strategy no`` saves)."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if is_complete(path) and not is_model_only(path):
            return path
    return None


def is_model_only(checkpoint: str) -> bool:
    """Whether ``checkpoint`` is the trained model alone (``--save_strategy no``'s last step:
    weights, tokenizer, ``mmembed.json``; no optimizer, scheduler or trainer state), as its
    marker says."""
    try:
        with open(os.path.join(checkpoint, COMPLETE_MARKER), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and bool(manifest.get("model_only"))


def check_complete(checkpoint: str) -> None:
    """Refuse a checkpoint whose save did not finish, that another tool wrote (saying what it
    is), a file of which was changed since it was saved (:func:`changed_files`, naming it), or
    that holds a pickle needing more than plain data (:func:`check_unpicklable`)."""
    if is_complete(checkpoint):
        changed = changed_files(checkpoint)
        if changed:
            raise UnsafeCheckpointError(
                f"{os.path.join(checkpoint, changed[0])}: refused: its content is not what was saved (sha256 differs "
                f"from the one in {COMPLETE_MARKER}{f'; {len(changed) - 1} more file(s) too' if len(changed) > 1 else ''}"
                "); the checkpoint was changed after it was written: resume from another checkpoint")
        check_unpicklable(checkpoint)
        return
    what = foreign_checkpoint(checkpoint)
    if what:
        raise IncompleteCheckpointError(
            f"{checkpoint} is {what}, not an mmembed checkpoint: mmembed does not resume another tool's optimizer, "
            f"scheduler and data position. Its weights load in mmembed: embed with `mmembed embed --model {checkpoint}`, "
            f"or merge with `mmembed export --adapters {checkpoint} --merge_lora true` and start a new run from the "
            "merged folder (--model); or add --resume_only_model true to train on from its weights and step count "
            "with a fresh optimizer (as ms-swift's --resume_only_model does)."
        )
    what = saved_model(checkpoint)
    if what:
        raise IncompleteCheckpointError(not_a_checkpoint(checkpoint, what))
    raise IncompleteCheckpointError(
        f"{checkpoint} is not a complete mmembed checkpoint (no {COMPLETE_MARKER}, or files it lists are missing: "
        "the run was probably killed while saving or deleting it); resume from an earlier checkpoint"
    )


# what a training checkpoint holds beside the model; a saved model (final or exported) has none of it
_TRAINING_STATE = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def saved_model(folder: str) -> str | None:
    """What an mmembed folder that is a model and no checkpoint is: "an `mmembed export`
    folder (...)" (``mmembed.json`` names the checkpoint it was exported from), "a final model
    saved without training state (...)" (``--save_strategy no``: the weights, tokenizer and
    ``mmembed.json``, whole, its marker saying ``model_only``; or, as older mmembed wrote it,
    no marker and no trainer / optimizer state: a checkpoint whose save was killed is still a
    staging folder, one being deleted has lost its marker first); None otherwise."""
    from ..model.io import read_mmembed_config

    name = os.path.basename(os.path.normpath(folder))
    if name.startswith((STAGING_PREFIX, _TRASH_PREFIX)):
        return None
    if os.path.exists(os.path.join(folder, COMPLETE_MARKER)):  # marked: whole, and the marker says what it holds
        return _FINAL_MODEL if is_model_only(folder) and is_complete(folder) else None
    try:
        config = read_mmembed_config(folder)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("exported_from"):
        return f"an `mmembed export` folder (merged from {config['exported_from']})"
    if any(os.path.exists(os.path.join(folder, f)) for f in _TRAINING_STATE):
        return None
    return _FINAL_MODEL  # as an mmembed before the marked final save wrote it


_FINAL_MODEL = "a final model saved without training state (as `--save_strategy no` saves it)"


def not_a_checkpoint(folder: str, what: str) -> str:
    """Why ``folder`` (a saved model, ``what`` as :func:`saved_model` says) cannot be resumed,
    and the two ways to go on from it."""
    start = (f"--adapters {folder}" if os.path.isfile(os.path.join(folder, "adapter_config.json"))
             else f"--model {folder}")
    return (f"{folder} is {what}, not a checkpoint: it holds no optimizer, scheduler or data position to resume. "
            f"Add --resume_only_model true to train on from its weights (the step count starts at 0), or start a new "
            f"run from it with {start}.")


def foreign_checkpoint(checkpoint: str) -> str | None:
    """What wrote ``checkpoint`` when it was not mmembed: "an ms-swift checkpoint (...)" when it
    holds ms-swift's args.json, "a ... folder without training state" for a model or adapter
    folder; None for a folder that looks like mmembed's (``mmembed.json``)."""
    if os.path.isfile(os.path.join(checkpoint, "mmembed.json")):
        return None
    args = os.path.join(checkpoint, "args.json")
    if os.path.isfile(args):
        with open(args, encoding="utf-8") as f:
            swift = json.load(f)
        if isinstance(swift, dict) and ("model_type" in swift or "tuner_type" in swift or "train_type" in swift):
            tuner = swift.get("tuner_type") or swift.get("train_type")
            return (f"an ms-swift checkpoint (args.json: --model_type {swift.get('model_type')}, --tuner_type {tuner}, "
                    f"--task_type {swift.get('task_type')})")
    if os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
        return "a PEFT adapter folder"
    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        return "a model folder"
    return None


def staging_folder(final: str) -> str:
    parent, name = os.path.split(os.path.normpath(final))
    return os.path.join(parent, STAGING_PREFIX + name)


def final_folder(path: str) -> str:
    """The name a (staging) folder will have once it is whole."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, name[len(STAGING_PREFIX):] if name.startswith(STAGING_PREFIX) else name)


def prepare_staging(final: str) -> str:
    """Create an empty staging folder for ``final`` (removing one a killed save left)."""
    staging = staging_folder(final)
    try:
        if os.path.exists(staging):
            shutil.rmtree(staging)
        os.makedirs(staging)
    except OSError as e:
        raise CheckpointWriteError(final, e) from e
    return staging


def discard_staging(final: str) -> None:
    shutil.rmtree(staging_folder(final), ignore_errors=True)


@contextlib.contextmanager
def hashed_torch_saves(root: str, written: dict[str, str]):
    """Within the block, ``torch.save`` to a path under ``root`` writes through a
    :class:`~mmembed.files.HashingWriter`, and the file's sha256 goes into ``written`` by its
    path relative to ``root`` (so the manifest need not read it back). Saves elsewhere, and
    to file objects, are left as they are. ``torch.save`` is looked up when called by the
    Trainer and DeepSpeed's checkpoint engine alike, so replacing the attribute reaches both."""
    import torch

    save = torch.save
    root = os.path.abspath(root)

    def hashing_save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        path = os.path.abspath(os.fspath(f))
        if os.path.commonpath([root, path]) != root:
            return save(obj, f, *args, **kwargs)
        with HashingWriter(path) as out:
            save(obj, out, *args, **kwargs)
        written[os.path.relpath(path, root)] = out.hexdigest()
        return None

    torch.save = hashing_save
    try:
        yield written
    finally:
        torch.save = save


def publish(final: str, step: int, model_only: bool = False, written: dict[str, str] | None = None) -> None:
    """Flush the staging folder of ``final``, mark it complete and give it ``final``'s name
    (``model_only``: the marker says it holds the model alone, nothing to resume training from).
    ``written``: the sha256 of the files hashed as they were written (:func:`hashed_torch_saves`,
    every process's), by path relative to the staging folder; the others are read back once."""
    staging = staging_folder(final)
    parent = os.path.dirname(staging)
    try:
        test_point("save:written")
        hashes: dict[str, str] = {}
        files = sync_tree(staging, hashes=hashes, written=written)
        marker = os.path.join(staging, COMPLETE_MARKER)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump({"step": step, "files": files, "sha256": hashes, **({"model_only": True} if model_only else {})},
                      f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        sync_folder(staging)
        test_point("save:marked")
        if os.path.exists(final):  # a folder of this step from an earlier (killed or resumed-over) run
            _move_aside(final)
        os.rename(staging, final)
        sync_folder(parent)
    except OSError as e:
        discard_staging(final)
        raise CheckpointWriteError(final, e) from e
    test_point("save:renamed")


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint so that no moment leaves it looking whole: the marker goes first."""
    if os.path.islink(path):  # a link to a folder elsewhere: the link goes, never what it points to
        os.unlink(path)
        return
    marker = os.path.join(path, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        sync_folder(path)
    test_point("rotate:unmarked")
    first = True
    for folder, _dirs, names in os.walk(path, topdown=False):
        for name in names:
            os.remove(os.path.join(folder, name))
            if first:
                test_point("rotate:deleting")
                first = False
        os.rmdir(folder)


def _move_aside(path: str) -> None:
    """Unmark ``path`` and rename it out of the way (deleted later): its name is free at once."""
    marker = os.path.join(path, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        sync_folder(path)
    parent, name = os.path.split(os.path.normpath(path))
    trash = os.path.join(parent, _TRASH_PREFIX + name)
    if os.path.exists(trash):
        shutil.rmtree(trash)
    os.rename(path, trash)


def rotate(output_dir: str, save_total_limit: int | None, keep: list[str]) -> list[str]:
    """``--save_total_limit``: keep the checkpoints in ``keep`` (the one just saved, the best)
    and the newest complete others up to the limit; delete the rest (incomplete folders
    included) and what killed saves or rotations left. Returns the deleted folders."""
    for path in leftovers(output_dir):
        if os.path.basename(path).startswith(_TRASH_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
    if not save_total_limit or save_total_limit <= 0:
        return []
    kept = {os.path.normpath(p) for p in keep if p}
    deleted = []
    for _, path in reversed(list_checkpoints(output_dir)):
        path = os.path.normpath(path)
        if path in kept:
            continue
        if len(kept) < save_total_limit and is_complete(path):
            kept.add(path)
            continue
        remove_checkpoint(path)
        deleted.append(path)
    test_point("rotate:done")
    return deleted


def set_aside_later_checkpoints(output_dir: str, resume: str, delete: bool = False) -> tuple[list[str], str | None]:
    """A run resumed from an earlier checkpoint of its own ``output_dir`` (a roll-back) must
    not live beside the later checkpoints of the run it abandons: ``--resume_from_checkpoint
    true`` would pick one of them after a crash, and rotation would keep them as the newest.
    They are moved, whole, into ``output_dir/superseded-<step>-<time>/`` (nothing is
    deleted), or deleted with ``delete`` (``--overwrite_output_dir``). Returns the checkpoints
    set aside and the folder they went to."""
    step = checkpoint_step(resume)
    if step is None or os.path.normpath(os.path.dirname(os.path.abspath(resume))) != \
            os.path.normpath(os.path.abspath(output_dir)):
        return [], None
    later = [path for s, path in list_checkpoints(output_dir) if s > step]
    if not later:
        return [], None
    if delete:
        for path in later:
            remove_checkpoint(path)
        return later, None
    folder = os.path.join(output_dir, f"superseded-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(folder, exist_ok=True)
    for path in later:
        os.rename(path, os.path.join(folder, os.path.basename(path)))
    sync_folder(output_dir)
    return later, folder


def clear_output_dir(output_dir: str) -> list[str]:
    """``--overwrite_output_dir``: delete every checkpoint and leftover of earlier runs."""
    removed = []
    for _, path in list_checkpoints(output_dir):
        remove_checkpoint(path)
        removed.append(path)
    for path in leftovers(output_dir):
        shutil.rmtree(path)
        removed.append(path)
    return removed


def save_failure(final: str, exc: BaseException, last_complete: str | None) -> CheckpointWriteError:
    """The error for a checkpoint that could not be written, naming the last whole one."""
    err = CheckpointWriteError(final, exc)
    err.args = (err.args[0], f"{err.args[1]} (nothing was left under that name; the last whole checkpoint is "
                             f"{last_complete or 'none: no checkpoint was completed'})")
    return err


__all__ = [
    "COMPLETE_MARKER", "CheckpointWriteError", "IncompleteCheckpointError", "UnsafeCheckpointError", "changed_files",
    "check_complete", "check_unpicklable", "clear_output_dir", "load_untrusted",
    "find_last_complete_checkpoint", "foreign_checkpoint", "is_complete", "is_model_only", "list_checkpoints",
    "not_a_checkpoint", "publish", "rotate", "saved_model", "set_aside_later_checkpoints",
]
