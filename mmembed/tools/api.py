"""Training from Python with the flags of ``mmembed sft`` as keyword arguments.

::

    import mmembed

    metrics = mmembed.train(model="path/to/model", dataset=["train.jsonl#1000"], loss_type="gist",
                            guide_model="path/to/guide", loss_kwargs={"margin": 0.05},
                            mrl_dims={64: 1.0, 384: 1.0}, num_train_epochs=1)
    print(metrics["last_checkpoint"])

Each keyword is the flag without ``--``; values become the command line the CLI would
parse (lists: several values; booleans: ``true``/``false``; dicts: JSON), so the Python
call and the command run the same checks and the same training. Several processes: run the
script under ``torchrun``, as with ``mmembed sft``.
"""

from __future__ import annotations

import json
from typing import Any


def to_argv(options: dict[str, Any]) -> list[str]:
    """``{"dataset": ["a", "b"], "strict": False, "loss_kwargs": {"margin": 0.1}}`` ->
    ``["--dataset", "a", "b", "--strict", "false", "--loss_kwargs", '{"margin": 0.1}']``;
    a None value is left out (the flag's default)."""
    argv: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        argv.append(f"--{name}")
        if isinstance(value, bool):
            argv.append("true" if value else "false")
        elif isinstance(value, dict):
            argv.append(json.dumps(value))
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"{name}: an empty list; leave the option out instead")
            argv += [str(v) for v in value]
        else:
            argv.append(str(value))
    return argv


def train(**options: Any) -> dict[str, Any]:
    """Fine-tune as ``mmembed sft`` with the same options would; returns the final metrics
    (train and eval) with ``last_checkpoint``, the folder of the last checkpoint.

    Raises:
        ValueError: a bad option (the message names the flag), or bad data
            (:class:`mmembed.data.DataError`, naming file, line and field).
    """
    from ..training.arguments import parse_sft_args
    from ..training.sft import run_sft

    argv = to_argv(options)
    try:
        args = parse_sft_args(argv)
    except SystemExit as e:  # the CLI's way out; from Python an exception with the reason
        reason = e.code if isinstance(e.code, str) else f"invalid options (argparse printed why): {argv}"
        raise ValueError(reason) from None
    metrics = run_sft(args)
    _after_the_run()
    return metrics


def _after_the_run() -> None:
    """Under several processes (a script of the user's run by torchrun): once every process is
    here, each has read its node's hub marker (``mmembed/training/hub_models.py``), which its
    writer then removes. The process group stays the script's."""
    import torch.distributed as dist

    from ..training.hub_models import remove_markers

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        remove_markers()
