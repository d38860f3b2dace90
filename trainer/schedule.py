"""The learning-rate schedule: warmup, then cosine / linear / constant decay to a floor."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr for the optimizer step with 0-based index `step`."""
    if step < warmup_steps:
        # (step + 1) so the very first update already moves the weights instead of running at lr 0.
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def scheduler_factory(*, total_steps: int, warmup_steps: int, kind: str,
                      min_lr_ratio: float) -> Callable[[Optimizer], LambdaLR]:
    """DeepSpeed builds the optimizer, so it gets a factory and calls it with that optimizer."""

    def factor(step: int) -> float:
        return lr_factor(step, total_steps=total_steps, warmup_steps=warmup_steps, kind=kind,
                         min_lr_ratio=min_lr_ratio)

    return lambda optimizer: LambdaLR(optimizer, factor)
