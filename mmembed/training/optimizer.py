"""Per-part learning rates as optimizer parameter groups.

``--vit_lr`` / ``--aligner_lr`` give the vision tower and the aligner learning rates of their
own (``sft.part_learning_rates`` maps each such parameter to its rate). The Trainer builds its
optimizer as usual (parameter groups split by weight decay); :func:`split_by_learning_rate`
then splits each group further by rate, keeping every other setting of the group, so the
learning-rate schedule scales every group alike and weight decay stays as the Trainer set it.
"""

from __future__ import annotations

from torch.optim import Optimizer


def split_by_learning_rate(optimizer: Optimizer, param_lrs: dict[int, float]) -> Optimizer:
    """``optimizer`` with each parameter group split into one group per learning rate, in place.

    Args:
        optimizer: An optimizer whose groups hold ``params`` and ``lr`` (and any other settings,
            copied to every group split from them).
        param_lrs: ``id(parameter) -> learning rate``; a parameter not named keeps its group's.

    Returns:
        ``optimizer`` itself. The groups come in the order of the original groups, and within
        one in the order each learning rate first appears; parameters keep their order; a
        group without parameters is dropped. An empty ``param_lrs`` leaves the optimizer as it is.
    """
    if not param_lrs:
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        by_lr: dict[float, list] = {}
        for p in group["params"]:
            by_lr.setdefault(param_lrs.get(id(p), group["lr"]), []).append(p)
        groups += [{**group, "params": params, "lr": lr} for lr, params in by_lr.items()]
    optimizer.param_groups.clear()
    for group in groups:
        optimizer.add_param_group(group)
    return optimizer
