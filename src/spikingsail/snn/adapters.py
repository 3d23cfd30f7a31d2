"""Recognising spiking layers and resetting their state, one small adapter per SNN library.

An adapter says whether a model holds stateful spiking modules of its library, resets their state
and sets their step mode. spikingjelly's is built in; snntorch or norse fit the same four methods
(``register_adapter``). A library that is not installed is simply never matched.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod

import torch


class SpikingAdapter(ABC):
    name: str

    @abstractmethod
    def available(self) -> bool:
        """Whether the library can be imported here (checked without importing it)."""

    @abstractmethod
    def stateful_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules of ``model`` that keep state between forward calls (neurons)."""

    @abstractmethod
    def reset(self, modules: list[torch.nn.Module]) -> None:
        """Put every module's state back to its reset value."""

    @abstractmethod
    def set_step_mode(self, model: torch.nn.Module, step_mode: str) -> None:
        """'s': one time step per call; 'm': a whole ``[T, N, ...]`` sequence per call."""


class SpikingJellyAdapter(SpikingAdapter):
    """spikingjelly.activation_based: neurons are ``MemoryModule`` subclasses with ``reset()``."""

    name = "spikingjelly"

    def available(self) -> bool:
        return importlib.util.find_spec("spikingjelly") is not None

    def stateful_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from spikingjelly.activation_based import base

        return [m for m in model.modules() if isinstance(m, base.MemoryModule)]

    def reset(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            module.reset()  # type: ignore[operator]  # MemoryModule.reset

    def set_step_mode(self, model: torch.nn.Module, step_mode: str) -> None:
        from spikingjelly.activation_based import functional

        functional.set_step_mode(model, step_mode)


_ADAPTERS: list[SpikingAdapter] = [SpikingJellyAdapter()]


def register_adapter(adapter: SpikingAdapter) -> None:
    """Teach the engine another SNN library (tried after those registered before it)."""
    _ADAPTERS.append(adapter)


def find_adapter(model: torch.nn.Module) -> tuple[SpikingAdapter, list[torch.nn.Module]] | None:
    """The first adapter whose library has stateful modules in ``model``, with those modules."""
    for adapter in _ADAPTERS:
        if adapter.available():
            modules = adapter.stateful_modules(model)
            if modules:
                return adapter, modules
    return None
