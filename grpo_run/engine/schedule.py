"""The learning-rate multiplier per optimizer step: linear warmup, then constant, linear or cosine decay.

`lr_factor(...)` returns the function torch's LambdaLR calls with the 0-based index s of the optimizer
step about to be taken (0 for the first); the step then runs at lr · factor(s).
- warmup (s < W): (s + 1)/(W + 1), rising towards 1 (W = 0: no warmup).
- after warmup, with D = max_steps − W decay steps and k = s − W:
    constant 1 · linear (D − k)/D, the first step at the full lr and the last at lr/D (transformers'
    `get_linear_schedule_with_warmup`, TRL's default) · cosine ½(1 + cos(π·k/D)).
Worked numbers (W = 0, max_steps = 4): linear 1, 0.75, 0.5, 0.25; cosine 1, 0.854, 0.5, 0.146.
"""

import math
from collections.abc import Callable

import torch

from grpo_run.config.schema import LRScheduler


def lr_factor(kind: LRScheduler, *, warmup_steps: int, max_steps: int) -> Callable[[int], float]:
    decay_steps = max(max_steps - warmup_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(step - warmup_steps, decay_steps) / decay_steps  # 0 at the first step after warmup
        if kind == LRScheduler.LINEAR:
            return 1.0 - progress
        if kind == LRScheduler.COSINE:
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def set_base_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lr: float) -> None:
    """Make `lr` the schedule's base lr (a resume whose trainer.lr changed): the next steps run at
    lr · factor(s), and the current lr becomes lr times the factor the schedule stands at (the same value
    when lr did not change). Only the scheduler's public `base_lrs` and the optimizer's param groups are
    written; the engines read their current lr from the param groups."""
    groups = scheduler.optimizer.param_groups
    factors = [
        group["lr"] / base if base else 1.0 for group, base in zip(groups, scheduler.base_lrs, strict=True)
    ]
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, factor in zip(groups, factors, strict=True):
        group["lr"] = lr * factor
        if "initial_lr" in group:
            group["initial_lr"] = lr
