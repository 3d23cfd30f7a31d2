"""Recognising spiking layers and resetting their state, one small adapter per SNN library.

An adapter says whether a model holds stateful spiking modules of its library, resets their state
and sets their step mode. spikingjelly's is built in; snntorch or norse fit the same four methods
(``register_adapter``). A library the process has not imported is never matched, and never
imported: a conventional model pays nothing.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod

import torch

_BASE = "spikingjelly.activation_based.base"


class SpikingAdapter(ABC):
    name: str

    @abstractmethod
    def available(self) -> bool:
        """Whether the library is in use in this process (checked without importing it)."""

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
        # A model made of spikingjelly modules has imported it; never import it for one that is not.
        return _BASE in sys.modules

    def stateful_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        memory_module = sys.modules[_BASE].MemoryModule
        return [m for m in model.modules() if isinstance(m, memory_module)]

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
