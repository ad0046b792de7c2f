"""Per-part learning rates as optimizer parameter groups (mmembed/training/optimizer.py).

The whole path (--vit_lr / --aligner_lr on a tiny Qwen2-VL through build_trainer) is
tests/training/test_swift_flags.py::test_vit_lr_and_aligner_lr_become_optimizer_groups_by_template_part.
"""

import torch

from mmembed.training.optimizer import split_by_learning_rate


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.full((2,), float(i))) for i in range(n)]


def _optimizer(decayed, not_decayed, lr=1e-4):
    """As the Trainer builds it: one group with weight decay, one without."""
    return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": not_decayed, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def _groups(optimizer):
    return [(g["lr"], g["weight_decay"], g["betas"], [id(p) for p in g["params"]]) for g in optimizer.param_groups]


def test_each_group_splits_by_learning_rate_keeping_its_other_settings():
    a, b, c, d, e = _params(5)
    optimizer = _optimizer([a, b, c], [d, e])
    lrs = {id(b): 1e-3, id(c): 1e-3, id(e): 2e-3}
    assert split_by_learning_rate(optimizer, lrs) is optimizer
    # groups in the original order; within one, each rate where it first appears; parameters keep their order
    assert _groups(optimizer) == [
        (1e-4, 0.1, (0.9, 0.95), [id(a)]),
        (1e-3, 0.1, (0.9, 0.95), [id(b), id(c)]),
        (1e-4, 0.0, (0.9, 0.95), [id(d)]),
        (2e-3, 0.0, (0.9, 0.95), [id(e)]),
    ]


def test_no_learning_rates_leave_the_optimizer_as_it_is():
    a, b = _params(2)
    optimizer = _optimizer([a], [b])
    before = list(optimizer.param_groups)
    assert split_by_learning_rate(optimizer, {}) is optimizer
    assert all(x is y for x, y in zip(optimizer.param_groups, before))
    assert len(optimizer.param_groups) == 2


def test_a_rate_equal_to_the_groups_keeps_one_group_and_an_empty_group_goes():
    a, b = _params(2)
    optimizer = _optimizer([a, b], [])
    split_by_learning_rate(optimizer, {id(b): 1e-4})
    assert _groups(optimizer) == [(1e-4, 0.1, (0.9, 0.95), [id(a), id(b)])]


def test_the_schedule_scales_every_group_and_each_parameter_steps_at_its_rate():
    """The scheduler (built after the optimizer, as the Trainer builds it) scales each group
    from its own rate; a plain SGD step moves each parameter by its group's current rate."""
    a, b = _params(2)
    optimizer = torch.optim.SGD([{"params": [a, b]}], lr=0.1)
    split_by_learning_rate(optimizer, {id(b): 0.4})
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    optimizer.step()
    schedule.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.2]
    torch.testing.assert_close(a.detach(), torch.full((2,), 0.0 - 0.1))
    torch.testing.assert_close(b.detach(), torch.full((2,), 1.0 - 0.4))
