"""Guards on a training run: when it must stop, and which step it must save.

- :func:`check_loss` / :func:`check_grad_norm`: a NaN or infinite loss or gradient norm stops
  the run with :class:`NonFiniteLossError` before the update writes non-finite weights (and so
  before any later checkpoint), naming the step and the last whole checkpoint. Every process
  checks and they agree (:func:`any_process`), so all stop at the same step and none waits in
  a collective the others never reach.
- :class:`ZeroLossStop`: a loss of exactly 0 with a gradient norm of exactly 0 on every
  process for ``--zero_loss_patience`` consecutive optimizer steps (default 10; 0: off) stops
  the run with :class:`ZeroLossError`, naming the step and the last whole checkpoint: nothing
  is being learned (a custom loss that returns a constant, rows that cannot contribute).
- :class:`SaveLastStep`: the last step is always saved as a checkpoint.

:class:`~mmembed.training.trainer.EmbeddingTrainer` calls the checks and adds the callbacks
(transformers ``TrainerCallback`` objects, acting through ``control``).
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from .distributed import world

_ADVICE = "Lower --learning_rate, raise INFONCE_TEMPERATURE, or check the data."


class NonFiniteLossError(FloatingPointError):
    pass


class ZeroLossError(RuntimeError):
    """The loss and the gradient were exactly 0 for ``--zero_loss_patience`` steps in a row."""


def any_process(flag: bool, device: torch.device | str) -> bool:
    """Whether ``flag`` is true on any process (every process must call it; one process:
    ``flag``). ``device``: where the collective's tensor lives (the backend's device)."""
    if world()[1] <= 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def merged_dicts(d: dict) -> dict:
    """Every process's ``d`` merged into one (every process must call it; one process: a copy)."""
    size = world()[1]
    if size <= 1:
        return dict(d)
    parts: list = [None] * size
    torch.distributed.all_gather_object(parts, d)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def check_loss(loss: torch.Tensor, step: int, last_checkpoint: str | None, device: torch.device | str) -> torch.Tensor:
    """``loss`` (one micro-batch's, before its backward pass) when it is finite on every
    process; else :class:`NonFiniteLossError` on all of them. ``step``: the step it belongs to
    (1-based); ``last_checkpoint``: the run's last whole checkpoint, named in the error."""
    bad = not bool(torch.isfinite(loss.detach()).all())
    if any_process(bad, device):
        value = loss.item() if bad and loss.numel() == 1 else "not finite on another process"
        raise NonFiniteLossError(f"loss is {value} at step {step}; {_stopped(last_checkpoint)}")
    return loss


def check_grad_norm(grad_norm: torch.Tensor | float | None, step: int, last_checkpoint: str | None) -> None:
    """:class:`NonFiniteLossError` when the step's gradient norm (the same on every process,
    None when not computed) is not finite: a finite loss can still give an infinite gradient
    (a tiny temperature, a huge learning rate). Not for fp16 loss scaling, where an overflow is
    expected and the step skipped."""
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        raise NonFiniteLossError(f"gradient norm is {float(grad_norm)} at step {step}; {_stopped(last_checkpoint)}")


def _stopped(last_checkpoint: str | None) -> str:
    return (f"training stopped, nothing saved after it. The last whole checkpoint is {last_checkpoint or 'none'}. "
            + _ADVICE)


class ZeroLossStop:
    """Counts the optimizer steps in a row whose loss was exactly 0 (every micro-batch, on
    every process) and whose gradient norm was exactly 0, and stops the run at ``patience``
    of them (0: never). The trainer tells it each micro-batch's loss (:meth:`saw_loss`) and
    each step's gradient norm (:meth:`saw_step`, before the optimizer steps, so the stopping
    step writes nothing)."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.run = 0  # steps in a row with loss 0 and gradient 0
        self._step = 0  # the step the micro-batches seen belong to
        self._all_zero = False  # every micro-batch loss of that step was exactly 0 here

    def saw_loss(self, loss: torch.Tensor, step: int) -> None:
        """One micro-batch's loss (finite, checked before) of ``step`` (1-based)."""
        if not self.patience:
            return
        zero = bool((loss.detach() == 0).all())
        if step != self._step:
            self._step, self._all_zero = step, zero
        else:
            self._all_zero = self._all_zero and zero

    def saw_step(self, grad_norm: torch.Tensor | float | None, step: int, last_checkpoint: str | None,
                 device: torch.device | str) -> None:
        """The gradient norm of ``step`` (the same on every process; None when not computed,
        which counts as not zero). :class:`ZeroLossError` on every process at the
        ``patience``-th step in a row with loss 0 everywhere and gradient norm 0."""
        if not self.patience:
            return
        zero = grad_norm is not None and float(grad_norm) == 0.0
        if zero:  # the gradient norm is global, so every process asks (or none does)
            zero = not any_process(not (self._all_zero and self._step == step), device)
        self.run = self.run + 1 if zero else 0
        if self.run >= self.patience:
            raise ZeroLossError(
                f"loss and gradient are exactly 0 for {self.run} steps in a row (steps {step - self.run + 1}-{step}): "
                f"nothing is being learned; training stopped at step {step}, nothing saved after it. The last whole "
                f"checkpoint is {last_checkpoint or 'none'}. Check the loss and that the rows can train "
                "(--zero_loss_patience 0 turns this check off)")


class SaveLastStep(TrainerCallback):
    """The last step is always saved as a checkpoint (the run's result), whatever
    ``--save_steps`` say about the steps before it. ``--save_strategy no`` saves no
    checkpoint at all: ``run_sft`` writes the final model alone."""

    def on_step_end(self, args, state, control, **kwargs):
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "no":
            return control
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_save = True
        return control
