"""The learning-rate schedule every strategy trains with, defined in global optimizer steps.

One-cycle (AdamW's learning rate and first momentum, torch's ``OneCycleLR``) over a model's whole
training: ``total_steps = epochs x steps_per_epoch``. Where a model trains (a task-parallel
trial, MOP sub-epochs hopping between workers, DDP ranks, the distillation student) and how
often it was stopped and resumed only change the step it starts from, never the curve: the
learning rate at global step ``s`` is the same function of ``s`` everywhere.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any


def steps_per_epoch(partition_rows: Iterable[int], batch_size: int) -> int:
    """Optimizer steps in one epoch that visits each partition once, a batch at a time
    (the last batch of a partition may be short: it is still a step)."""
    return sum(math.ceil(int(rows) / batch_size) for rows in partition_rows if int(rows) > 0)


def one_cycle(optimizer: Any, max_lr: float, total_steps: int, start_step: int = 0) -> Any:
    """The schedule over ``total_steps``, positioned at global step ``start_step`` (the optimizer's
    learning rate and momentum are set for that step; each ``step()`` advances one)."""
    import torch

    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=max_lr, total_steps=max(int(total_steps), 1)
    )
    if start_step > 0:
        scheduler.last_epoch = min(int(start_step), scheduler.total_steps) - 1
        with warnings.catch_warnings():  # positioning, not a step taken before optimizer.step()
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step.*")
            scheduler.step()
    return scheduler
