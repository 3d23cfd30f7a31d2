"""The engine's state in parts, each ``Stateful`` (``state_dict()`` / ``load_state_dict()``).

A checkpoint's ``engine.pt`` is the union of the parts' state dicts (``checkpoint/engine_state.py``
writes and reads it without knowing the engine): each part writes its own top-level keys and reads
them back from the whole dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from spikingsail.data.loader import ShardedLoader

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


@dataclass(kw_only=True)
class StepCounters:
    """DeepSpeed's bookkeeping: every ``step()`` call is a micro-step; an optimizer step ends an
    accumulation window of ``accumulation`` micro-steps."""

    accumulation: int
    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "gradient_accumulation_steps": self.accumulation,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.global_steps = int(state_dict["global_steps"])
        self.micro_steps = int(state_dict["micro_steps"])
        self.global_samples = int(state_dict["global_samples"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        if not self.micro_steps % int(state_dict["gradient_accumulation_steps"]):
            # on a step boundary the split of train_batch_size may have changed: count the
            # micro-steps in this run's accumulation, so that the next window is whole
            self.micro_steps = self.global_steps * self.accumulation


class Entry:
    """The state of ``part`` (None: there is none) under one key of the checkpoint's dict."""

    def __init__(self, key: str, part: Stateful | None) -> None:
        self.key = key
        self.part = part

    def state_dict(self) -> dict[str, Any]:
        return {self.key: None if self.part is None else self.part.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(self.key)
        if self.part is not None and saved is not None:
            self.part.load_state_dict(saved)


class OptimizerHyperparameters:
    """The optimizer's group settings (learning rate, weight decay, ...) without the parameters;
    also kept apart from the model/optimizer state because an optimizer without per-parameter
    state (plain SGD) has none there."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        groups = self.optimizer.param_groups
        return {"optimizer_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["optimizer_groups"]
        if len(saved) == len(self.optimizer.param_groups):
            for group, settings in zip(self.optimizer.param_groups, saved, strict=True):
                group.update(settings)


class LoaderPositions:
    """Where each of the engine's data loaders is, by the order they were made; positions loaded
    before a loader exists wait for it."""

    def __init__(self) -> None:
        self.loaders: list[ShardedLoader] = []
        self._pending: dict[int, dict[str, int]] = {}
        self._made_from: list[tuple[object, dict[str, Any]]] = []  # each loader's dataset and arguments

    def add(self, loader: ShardedLoader, dataset: object, arguments: dict[str, Any]) -> None:
        pending = self._pending.pop(len(self.loaders), None)
        if pending is not None:
            loader.load_state_dict(pending)
        self.loaders.append(loader)
        self._made_from.append((dataset, arguments))

    def made_before(self, dataset: object, arguments: dict[str, Any]) -> ShardedLoader | None:
        """The loader made from this very dataset object with these arguments, if there is one."""
        for loader, (made_from, made_with) in zip(self.loaders, self._made_from, strict=True):
            if made_from is dataset and made_with == arguments:
                return loader
        return None

    def restore(self, states: list[dict[str, int]]) -> None:
        self._pending = dict(enumerate(states))
        for index, loader in enumerate(self.loaders):
            if index in self._pending:
                loader.load_state_dict(self._pending.pop(index))

    def state_dict(self) -> dict[str, Any]:
        return {"loaders": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restore(list(state_dict["loaders"]))
