"""Keeping the user's scheduler in charge when a backend replaces the optimizer.

ZeRO-1 (``ZeroRedundancyOptimizer``) and Horovod (``DistributedOptimizer``) step a new optimizer
object. A scheduler the user built on the old one goes on writing the learning rate into the old
one's parameter groups; unless the new optimizer steps with those same group dicts, the schedule
would be silently ignored. So the groups must be shared (then the scheduler is re-pointed at the new
optimizer, which it reads and whose steps it counts), or the combination is refused.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from spikingsail.errors import BackendError


def rebind_scheduler(
    scheduler: Any, given: torch.optim.Optimizer, used: torch.optim.Optimizer, backend: str
) -> None:
    """Point ``scheduler`` from ``given`` at ``used``, the optimizer the backend steps instead."""
    shared = len(used.param_groups) == len(given.param_groups) and all(
        a is b for a, b in zip(used.param_groups, given.param_groups, strict=True)
    )
    if not shared:
        raise BackendError(
            f"backend {backend} steps a {type(used).__name__} in place of the {type(given).__name__} "
            "your lr_scheduler was built on, and they do not share parameter groups",
            "the scheduler would keep changing the learning rate of an optimizer that never steps: "
            "the schedule would be silently ignored",
            'let the config build the scheduler ("scheduler": {"type": ..., "params": {...}}), or build '
            "yours on the optimizer that initialize() returns and step it yourself",
        )
    if getattr(scheduler, "optimizer", None) is given:
        scheduler.optimizer = used
        _count_steps_for_scheduler(used)


def _count_steps_for_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way torch's LRScheduler does for the optimizer it was built on, so
    that its first ``step()`` does not warn that the optimizer was never stepped."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)

    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        stepped = owner()
        if stepped is not None:
            stepped._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]
