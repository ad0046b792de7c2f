"""The run's guards, one process (mmembed/training/guards.py). Whole runs stopping at a
non-finite loss or gradient, on one and two processes, are tests/training/test_nonfinite.py."""

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl
from transformers.trainer_utils import SaveStrategy

from mmembed.training.guards import NonFiniteLossError, SaveLastStep, any_process, check_grad_norm, check_loss


def test_a_finite_loss_passes_as_it_is():
    loss = torch.tensor(0.25, requires_grad=True)
    assert check_loss(loss, 3, None, "cpu") is loss


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_a_non_finite_loss_names_the_step_and_the_last_checkpoint(value, shown):
    with pytest.raises(NonFiniteLossError) as e:
        check_loss(torch.tensor(value), 3, "out/checkpoint-2", "cpu")
    assert str(e.value) == (f"loss is {shown} at step 3; training stopped, nothing saved after it. The last whole "
                            "checkpoint is out/checkpoint-2. Lower --learning_rate, raise INFONCE_TEMPERATURE, or "
                            "check the data.")
    with pytest.raises(NonFiniteLossError, match="The last whole checkpoint is none"):
        check_loss(torch.tensor(value), 1, None, "cpu")


def test_a_non_finite_gradient_norm_stops_a_finite_one_or_none_passes():
    check_grad_norm(None, 4, None)
    check_grad_norm(torch.tensor(12.5), 4, None)
    check_grad_norm(3.0, 4, None)
    with pytest.raises(NonFiniteLossError, match=r"^gradient norm is inf at step 4; training stopped, nothing saved "
                                                 r"after it\. The last whole checkpoint is out/checkpoint-3\."):
        check_grad_norm(torch.tensor(float("inf")), 4, "out/checkpoint-3")
    with pytest.raises(NonFiniteLossError, match="gradient norm is nan at step 1"):
        check_grad_norm(float("nan"), 1, None)


def test_one_process_agrees_with_itself():
    assert any_process(True, "cpu") is True
    assert any_process(False, "cpu") is False


@pytest.mark.parametrize("strategy, step, saved", [
    ("steps", 5, True),   # the last step
    ("steps", 4, False),  # before it: --save_steps decide
    ("epoch", 5, True),
    ("no", 5, False),     # --save_strategy no: run_sft writes the final model alone
])
def test_the_last_step_is_saved_unless_nothing_is(strategy, step, saved):
    args = SimpleNamespace(save_strategy=SaveStrategy(strategy))  # as TrainingArguments holds it
    state = SimpleNamespace(max_steps=5, global_step=step)
    control = SaveLastStep().on_step_end(args, state, TrainerControl())
    assert control.should_save is saved
