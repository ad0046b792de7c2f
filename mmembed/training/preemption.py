"""Graceful preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job) or
SIGUSR1 (what SLURM's ``--signal`` sends) ends training after the current optimizer step with
a whole checkpoint, instead of losing everything since the last one.

- :class:`PreemptionStop` (a transformers ``TrainerCallback``) installs the handlers for the
  training loop only (:meth:`PreemptionStop.handling`, in the main thread; the previous
  handlers come back after). The first signal only sets a flag and gives both signals back
  their default action, so a second one ends the process at once (the staging protocol of
  :mod:`mmembed.training.checkpoints` leaves the last whole checkpoint intact).
- At the end of every optimizer step all processes agree whether a stop was requested on any
  of them (:func:`~mmembed.training.guards.any_process`: a launcher may signal rank 0 alone),
  so they stop at the same step; that step is saved through the Trainer's normal save
  (``control.should_save``) unless ``--save_strategy no``, where ``run_sft`` writes the final
  model alone.
- ``run_sft`` then raises :class:`Preempted`, which ``mmembed sft`` reports in one line saying
  how to resume, with exit code 143 (128 + SIGTERM, what a job killed by SIGTERM ends with).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from transformers import TrainerCallback

from . import hooks
from .guards import any_process

EXIT_CODE = 143  # 128 + SIGTERM
SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(Exception):
    """Training stopped on SIGTERM / SIGUSR1 after a whole checkpoint (or, with
    ``--save_strategy no``, the final model alone) was written; the message says how to go on."""


class PreemptionStop(TrainerCallback):
    """Stops training at the end of the optimizer step during which SIGTERM or SIGUSR1 came
    (on any process), saving that step. ``requested``: the signal's name once one came;
    ``stopped_at``: the step training stopped at because of it (None: it did not)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self.stopped_at: int | None = None

    # ---- the handlers ---------------------------------------------------------------
    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.requested = self.requested or name
        for s in SIGNALS:  # a second signal: the default action, at once (even inside a long C call)
            signal.signal(getattr(signal, s), signal.SIG_DFL)
        os.write(2, (f"mmembed: {name} received: finishing the current step and saving a checkpoint; "
                     f"send it again to stop at once\n").encode())

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Around the training loop: the handlers installed (in the main thread only; elsewhere
        signals cannot be caught and nothing changes), the previous ones restored after."""
        self.requested = self.stopped_at = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(getattr(signal, s)) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(getattr(signal, s), self._handle)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(getattr(signal, s), handler if handler is not None else signal.SIG_DFL)

    # ---- the callback ---------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        hooks.test_point("train:step")  # test-only: a test can signal at a known step
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if any_process(self.requested is not None, args.device):  # every process, every step
            self.stopped_at = state.global_step
            self.requested = self.requested or "a signal on another process"
            control.should_training_stop = True
            if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        # stopped mid-epoch: the step is saved already; --save_strategy epoch would save it again
        if self.stopped_at is not None and self.stopped_at == state.global_step:
            control.should_save = False
        return control


def preempted(stop: PreemptionStop, step: int, checkpoint: str | None, resumable: bool) -> Preempted:
    """The exception ``run_sft`` raises once the stopped run has saved ``checkpoint`` at
    ``step``; ``resumable``: whether it is a training checkpoint (not ``--save_strategy no``'s
    model alone)."""
    what = f"{stop.requested} at step {step}"
    if resumable:
        return Preempted(f"stopped by {what}: saved the whole checkpoint {checkpoint}; to go on, run the same command "
                         "with the same --output_dir and --resume_from_checkpoint true")
    return Preempted(f"stopped by {what}: saved the trained model alone as {checkpoint} (--save_strategy no keeps no "
                     "optimizer or data position, so the run cannot resume); train on from its weights with "
                     f"--resume_from_checkpoint {checkpoint} --resume_only_model true, or save checkpoints "
                     "(--save_strategy steps) to resume exactly")
