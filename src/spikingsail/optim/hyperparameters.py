"""The values each optimizer and schedule hyper-parameter of a config may take.

torch.optim checks few of them (``lr=inf`` and SGD's ``lr=nan`` pass, a single beta fails with a
bare ``ValueError`` inside torch), so every one is checked here, by name, with the key path in
the message: ``optimizer.params.betas``, ``scheduler.params.cycle_first_step_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from spikingsail.checks import FLOAT32_MAX, Range, check_number
from spikingsail.errors import ConfigError


class NamedSection(Protocol):
    """A config's ``optimizer`` or ``scheduler`` section: a type name and its keyword arguments."""

    @property
    def type(self) -> str: ...
    @property
    def params(self) -> Mapping[str, Any]: ...


# torch applies these as scalars to float32 tensors; a larger one fails inside the first step.
_IN_FLOAT32 = "torch applies it to float32 tensors, so it must be a float32 number"
_RATE = Range(0, FLOAT32_MAX, why=f"a learning rate is ≥ 0, and {_IN_FLOAT32}")
_NON_NEGATIVE = Range(0, FLOAT32_MAX, why=_IN_FLOAT32)
_DECAY = Range(
    0, 1, high_open=True, why="it is the weight of the running average's past, so 1 or more never forgets"
)
_STEPS = Range(0, integer=True)
_MOMENTUM = Range(0, 1, high_open=True, why="it is Adam's beta1 while the schedule runs")
_FLAGS = frozenset({"amsgrad", "maximize", "nesterov", "centered", "decoupled_weight_decay", "capturable",
                    "differentiable", "adam_w_mode", "torch_adam", "cycle_momentum"})  # fmt: skip
_OPTIONAL_FLAGS = frozenset({"foreach", "fused"})  # null: torch chooses
_NULLABLE = frozenset({"cycle_second_step_size", "cycle_second_stair_count"})  # null: as the first half

OPTIMIZER_PARAMS: dict[str, Range] = {
    "lr": _RATE,
    "eps": Range(
        0,
        FLOAT32_MAX,
        low_open=True,
        fix="e.g. 1e-8",
        why=f"it keeps a division away from zero, and {_IN_FLOAT32}",
    ),
    "weight_decay": _NON_NEGATIVE,
    "momentum": Range(0, 1, high_open=True, why="with momentum ≥ 1 the velocity grows without bound"),
    "dampening": Range(0, 1),
    "alpha": _DECAY,
    "lr_decay": _NON_NEGATIVE,
    "initial_accumulator_value": _NON_NEGATIVE,
    "momentum_decay": _NON_NEGATIVE,
}
SCHEDULER_PARAMS: dict[str, Range] = {
    "warmup_min_lr": _RATE,
    "warmup_max_lr": _RATE,
    "warmup_num_steps": Range(1, integer=True, why="DeepSpeed refuses 0; 1 and 2 both warm up over 2 steps"),
    "total_num_steps": Range(1, integer=True),
    "last_batch_iteration": Range(-1, integer=True, why="-1 starts the schedule from its beginning"),
    "cycle_min_lr": _RATE,
    "cycle_max_lr": _RATE,
    "decay_lr_rate": _NON_NEGATIVE,
    "cycle_first_step_size": Range(
        1, integer=True, why="the first half of the cycle needs at least one step"
    ),
    "cycle_second_step_size": _STEPS,
    "cycle_first_stair_count": _STEPS,
    "cycle_second_stair_count": _STEPS,
    "decay_step_size": Range(0, integer=True, fix="0 turns the decay off"),
    "cycle_min_mom": _MOMENTUM,
    "cycle_max_mom": _MOMENTUM,
    "decay_mom_rate": _NON_NEGATIVE,
}


def checked_optimizer_params(params: Mapping[str, Any], class_name: str, where: str) -> dict[str, Any]:
    """``params`` with each value checked (and betas made a tuple); unknown names are left to the caller."""
    out = {
        name: _checked(value, name, OPTIMIZER_PARAMS, where, "optimizer.params")
        for name, value in params.items()
    }
    if "betas" in out:
        out["betas"] = _betas(out["betas"], class_name, where)
    if out.get("differentiable"):
        raise ConfigError(
            f"{where}: optimizer.params.differentiable is true",
            "it makes optimizer.step() differentiable for meta-learning; the engine steps without autograd, "
            "where torch then fails on the first step",
            "remove optimizer.params.differentiable",
        )
    if out.get("nesterov") and (out.get("momentum", 0) <= 0 or out.get("dampening", 0) != 0):
        raise ConfigError(
            f"{where}: optimizer.params.nesterov is true, but optimizer.params.momentum is "
            f"{out.get('momentum', 0)} and optimizer.params.dampening {out.get('dampening', 0)}",
            "Nesterov momentum needs a momentum > 0 and no dampening",
            'set e.g. "momentum": 0.9 and "dampening": 0, or "nesterov": false',
        )
    return out


def checked_scheduler_params(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``params`` with each value checked (rates as floats); unknown names are left to the caller."""
    out = {
        name: _checked(value, name, SCHEDULER_PARAMS, where, "scheduler.params")
        for name, value in params.items()
    }
    if "warmup_type" in params and params["warmup_type"] not in ("log", "linear"):
        raise ConfigError(
            f"{where}: scheduler.params.warmup_type is {params['warmup_type']!r}",
            "the warm-up rises along a log or a linear curve",
            'use "log" or "linear"',
        )
    return out


def _checked(value: Any, name: str, ranges: Mapping[str, Range], where: str, scope: str) -> Any:
    key = f"{scope}.{name}"
    if name in ranges and not (value is None and name in _NULLABLE):
        return check_number(value, ranges[name], key, where)
    nullable = name in _OPTIONAL_FLAGS
    if (name in _FLAGS or nullable) and not (isinstance(value, bool) or (value is None and nullable)):
        raise ConfigError(
            f"{where}: {key} is {value!r}",
            "it is a switch",
            f"set {key} to true or false" + (" (or null: torch chooses)" if nullable else ""),
        )
    return value


def _betas(value: Any, class_name: str, where: str) -> tuple[float, float]:
    key = "optimizer.params.betas"
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(
            f"{where}: {key} is {value!r}",
            f"{class_name} takes a pair (beta1, beta2): the decay rates of the gradient's running mean and of "
            "its square",
            f'set {key} to two numbers in [0, 1), e.g. "betas": [0.9, 0.999]',
        )
    beta = Range(0, 1, high_open=True, why="a beta is the weight of a running average's past")
    first, second = (check_number(b, beta, f"{key}[{i}]", where) for i, b in enumerate(value))
    return float(first), float(second)
