"""DeepSpeed's learning-rate schedules, stepped once per optimizer step.

Each schedule sets the learning rate of every parameter group from the index of the last optimizer
step (``last_batch_iteration``), exactly as DeepSpeed's ``lr_schedules`` define them, so a DeepSpeed
config trains with the same learning rates here. Before the first step the rate is the schedule's
minimum.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch

from spikingsail.errors import ConfigError
from spikingsail.optim.hyperparameters import NamedSection, checked_scheduler_params

log = logging.getLogger(__name__)


class IterationSchedule:
    """A schedule that is a pure function of the optimizer-step index."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = [float(g["lr"]) for g in optimizer.param_groups]

    def lr_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def step(self, iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if iteration is None else iteration
        self._apply(self.lr_at(self.last_batch_iteration))

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if self.last_batch_iteration >= 0:
            self._apply(self.lr_at(self.last_batch_iteration))


class WarmupLR(IterationSchedule):
    """Rise from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then hold.

    Without warmup_max_lr each parameter group rises to its own learning rate as the optimizer was
    built with it (DeepSpeed's WarmupLR does the same; its docstring's 0.001 is WarmupDecayLR's).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', not {warmup_type!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = warmup_min_lr
        self.max_lrs = (
            [float(g["lr"]) for g in optimizer.param_groups]
            if warmup_max_lr is None
            else [warmup_max_lr] * len(optimizer.param_groups)
        )
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply([warmup_min_lr] * len(optimizer.param_groups))

    def gamma(self, iteration: int) -> float:
        if iteration >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return math.log(iteration + 1) / math.log(self.warmup_num_steps)
        return iteration / self.warmup_num_steps

    def lr_at(self, iteration: int) -> list[float]:
        gamma = self.gamma(iteration)
        return [self.min_lr + (max_lr - self.min_lr) * gamma for max_lr in self.max_lrs]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if total_num_steps < warmup_num_steps:
            log.warning(
                "WarmupDecayLR: total_num_steps %d < warmup_num_steps %d", total_num_steps, warmup_num_steps
            )

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        return max(
            0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps)
        )


class OneCycle(IterationSchedule):
    """Up from cycle_min_lr to cycle_max_lr and back, then decay; momentum (Adam's beta1) moves inversely.

    As in DeepSpeed, the cycle's position counts the step being taken (iteration + 1), a stair count
    holds the rate flat over that many stairs per half, the decay divides the minimum rate by
    1 + decay_lr_rate × (steps past the cycle / decay_step_size), and cycling momentum sets Adam's
    beta2 to 0.99.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first_size = float(cycle_first_step_size)
        self.second_size = float(
            self.first_size if cycle_second_step_size is None else cycle_second_step_size
        )
        self.total_size = self.first_size + self.second_size
        self.step_ratio = self.first_size / self.total_size
        self.stairs = (cycle_first_stair_count,
                       cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count)  # fmt: skip
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.decay_step_size = decay_step_size
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.warning("OneCycle: %s has no betas; momentum is not cycled", type(optimizer).__name__)
        if last_batch_iteration == -1:
            self._apply([cycle_min_lr] * len(optimizer.param_groups))
            self._set_beta1(cycle_min_mom)

    def _set_beta1(self, beta1: float) -> None:
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (beta1, 0.99)  # DeepSpeed's OneCycle fixes beta2 at 0.99

    def _scale(self, iteration: int) -> float:
        """Where in the cycle the step ``iteration`` is: 0 at the minimum, 1 at the peak."""
        position = iteration + 1
        x = 1.0 + position / self.total_size - math.floor(1 + position / self.total_size)
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.stairs[0] if rising else self.stairs[1]
        if stairs > 0:  # from the integer position: the float scale can land just under a stair
            into = position % self.total_size
            if into <= self.first_size:
                scale = math.floor(into * stairs / self.first_size) / stairs
            else:
                scale = math.floor((self.total_size - into) * stairs / self.second_size) / stairs
        return scale

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            lr = self.min_lr + (self.max_lr - self.min_lr) * scale
            self._set_beta1(self.max_mom - (self.max_mom - self.min_mom) * scale)
        else:
            past = iteration - self.total_size + 1
            interval = past / self.decay_step_size if self.decay_step_size else 0.0
            lr = self.min_lr / (1 + self.decay_lr_rate * interval)
            self._set_beta1(self.max_mom * (1 + self.decay_mom_rate * interval))
        return [lr] * len(self.optimizer.param_groups)


SCHEDULERS: dict[str, type[IterationSchedule]] = {
    "warmuplr": WarmupLR,
    "warmupdecaylr": WarmupDecayLR,
    "onecycle": OneCycle,
}


def check_scheduler(config: NamedSection, where: str) -> type[IterationSchedule]:
    cls = SCHEDULERS.get(config.type.lower())
    if cls is None:
        raise ConfigError(
            f"{where}: scheduler.type '{config.type}' is not supported",
            fix=f"use one of {', '.join(c.__name__ for c in SCHEDULERS.values())}, "
            "or pass your own scheduler as lr_scheduler=",
        )
    signature = inspect.signature(cls.__init__)
    accepted = set(signature.parameters) - {"self", "optimizer"}
    for key in config.params:
        if key not in accepted:
            raise ConfigError(
                f"{where}: scheduler.params has '{key}', which {cls.__name__} does not take",
                fix=f"valid params: {', '.join(sorted(accepted))}",
            )
    required = [
        n
        for n, p in signature.parameters.items()
        if p.default is inspect.Parameter.empty and n not in ("self", "optimizer")
    ]
    for key in required:
        if key not in config.params:
            raise ConfigError(f"{where}: {cls.__name__} needs scheduler.params.{key}", fix=f'add "{key}"')
    checked_scheduler_params(config.params, where)
    return cls


def build_scheduler(config: NamedSection, optimizer: torch.optim.Optimizer, where: str) -> IterationSchedule:
    cls = check_scheduler(config, where)
    try:
        return cls(optimizer, **checked_scheduler_params(config.params, where))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: scheduler {cls.__name__} rejected its params", str(err)) from None
