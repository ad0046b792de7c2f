"""A run's model flags resolved to local folders before anything reads them: ``--model``,
``--teacher_model``, ``--guide_model`` and ``--eval_beir_first_stage`` may name hub ids
(:mod:`mmembed.hub`), downloaded once per node.

Under several processes the node's first process (local rank 0) downloads while the node's
others wait, then they resolve the same folder from the cache with no request. The wait is not
a collective of the process group, whose ``--ddp_timeout`` (30 minutes) a large download
would outlast: the others poll for a small file the first process writes when it is done
(with its folders, or the one-line error they then raise as well), named by a token the run's
first process hands out through the process group. The first process removes that file once
every process has read it: after the run's final barrier (:func:`remove_markers`, called by
``mmembed sft``'s exit), so the temporary folder keeps none of them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable

from ..environment import Environment
from ..errors import UsageError
from ..hub import HubOptions, local_folder, resolve_model
from .arguments import SftArguments
from .device_flags import dtype_after_download
from .flag_checks import has_accelerator

logger = logging.getLogger("mmembed")

#: the flags of ``mmembed sft`` that name a model (``--adapters`` are local checkpoints)
MODEL_FLAGS = ("model", "teacher_model", "guide_model", "eval_beir_first_stage")

_POLL_SECONDS = 0.5
_markers: list[str] = []  # the marker files this process wrote (removed by remove_markers)


def resolve_model_flags(args: SftArguments, environment: Environment | None = None) -> dict[str, str]:
    """Put the local folder of every model flag of ``args`` that names a hub id in its place
    (``args.model = ".../snapshots/COMMIT"``); returns flag -> id for those. Folders are left
    as they are. With several processes, the node's first downloads and the others wait
    (:func:`once_per_node`). On a GPU, the LoRA dtype default that needs the model's
    ``config.json`` is chosen now that it is there. ``environment``: the variables the run
    read at its start (``USE_HF``, the offline switches; None: read now)."""
    wanted = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f, None) and local_folder(getattr(args, f)) is None}
    if not wanted:
        return {}
    options = HubOptions.from_flags(args.use_hf, args.model_revision, args.hub_token, environment)

    def resolve(cached_only: bool) -> dict[str, str]:
        return {f: resolve_model(spec, f"--{f}", options.for_flag(f"--{f}"), cached_only=cached_only)
                for f, spec in wanted.items()}

    folders = once_per_node(args, resolve)
    for flag, folder in folders.items():
        logger.info("--%s %s: %s", flag, wanted[flag], folder)
        setattr(args, flag, folder)
    if "model" in folders:
        args.device_defaults = [*getattr(args, "device_defaults", []), *dtype_after_download(args, has_accelerator())]
    return wanted


def once_per_node(args: SftArguments, resolve: Callable[[bool], dict[str, str]]) -> dict[str, str]:
    """``resolve(False)`` (downloads allowed) in the node's first process, ``resolve(True)``
    (the cache only) in the node's others once the first is done; one process, or no process
    group: ``resolve(False)`` here. An error of the first process is raised by all."""
    import torch.distributed as dist

    if args.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return resolve(False)
    token = [uuid.uuid4().hex if args.process_index == 0 else None]
    dist.broadcast_object_list(token, src=0)  # quick: every process is here
    node = args.process_index - args.local_process_index
    marker = os.path.join(tempfile.gettempdir(), f"mmembed-hub-{token[0]}-{node}.json")
    if args.local_process_index == 0:
        _markers.append(marker)
        try:
            folders = resolve(False)
        except UsageError as e:
            _write(marker, {"error": str(e)})
            raise
        except BaseException as e:  # noqa: BLE001 (the others must not wait for ever)
            _write(marker, {"error": f"the node's first process failed to resolve the model flags: {e}"})
            raise
        _write(marker, {"folders": folders})
        return folders
    while not os.path.exists(marker):
        time.sleep(_POLL_SECONDS)
    with open(marker, encoding="utf-8") as f:
        done = json.load(f)
    if "error" in done:
        raise UsageError(done["error"])
    return resolve(True)


def remove_markers() -> None:
    """Remove the marker files this process wrote in :func:`once_per_node`. Call it only once
    every process of the group has read its node's marker: after a barrier of the whole group
    that follows the resolution (the run's final one, ``mmembed/tools/cli.py``); a waiting
    process that found no file would wait for ever."""
    while _markers:
        try:
            os.remove(_markers.pop())
        except FileNotFoundError:
            pass


def _write(path: str, content: dict) -> None:
    """Whole or absent: the waiting processes never read half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f)
    os.replace(tmp, path)
