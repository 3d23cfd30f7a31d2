"""Optimizers named in a config's ``optimizer`` section, built from torch.optim.

DeepSpeed's meaning is kept: ``Adam`` is decoupled-weight-decay Adam (AdamW) unless
``adam_w_mode`` is false, and weight decay defaults to 0 for every type.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from spikingsail.errors import ConfigError
from spikingsail.optim.hyperparameters import NamedSection, checked_optimizer_params

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
}
# DeepSpeed-only switches that choose an implementation rather than a hyper-parameter.
_DEEPSPEED_SWITCHES = {"adam_w_mode", "torch_adam", "fused"}


def resolve_optimizer(config: NamedSection, where: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch class and keyword arguments a config names; raises ``ConfigError`` if it cannot."""
    name = config.type.lower()
    if name not in OPTIMIZERS:
        raise ConfigError(
            f"{where}: optimizer.type '{config.type}' is not supported",
            "SpikingSail builds optimizers from torch.optim",
            f"use one of {', '.join(sorted(c.__name__ for c in OPTIMIZERS.values()))}, "
            "or create the optimizer yourself and pass it to SpikingSail(args, model, optimizer)",
        )
    params = dict(config.params)
    switches = checked_optimizer_params(
        {k: params.pop(k) for k in _DEEPSPEED_SWITCHES if k in params}, config.type, where
    )
    cls = OPTIMIZERS[name]
    if name == "adam" and switches.get("adam_w_mode", True):
        cls = torch.optim.AdamW
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        as_adamw = " (DeepSpeed's Adam is AdamW unless optimizer.params.adam_w_mode is false)"
        raise ConfigError(
            f"{where}: optimizer.params has '{unknown[0]}', which {cls.__name__} does not take",
            f"the params are passed to torch.optim.{cls.__name__}" + (as_adamw if name == "adam" else ""),
            f"valid params: {', '.join(sorted(accepted | (_DEEPSPEED_SWITCHES if name == 'adam' else set())))}",
        )
    params = checked_optimizer_params(params, cls.__name__, where)
    if "weight_decay" in accepted:
        params.setdefault("weight_decay", 0.0)
    return cls, params


def build_optimizer(
    config: NamedSection, parameters: Iterable[torch.nn.Parameter], where: str
) -> torch.optim.Optimizer:
    cls, params = resolve_optimizer(config, where)
    parameters = list(parameters)
    if params.get("capturable") and any(p.device.type == "cpu" for p in parameters):
        raise ConfigError(
            f"{where}: optimizer.params.capturable is true, but the model is on the CPU",
            "capturable keeps the optimizer's state on the GPU for CUDA graphs; torch refuses it for CPU "
            "tensors on the first step",
            "remove optimizer.params.capturable",
        )
    try:
        return cls(parameters, **params)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"{where}: torch.optim.{cls.__name__} rejected optimizer.params {config.params}",
            str(err),
            "fix the value named above",
        ) from None
