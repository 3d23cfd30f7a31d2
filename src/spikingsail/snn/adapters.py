"""Recognising spiking layers and resetting their state, one small adapter per SNN library.

An adapter says whether a model holds stateful spiking modules of its library, resets their state
and sets their step mode, and (for ``snn.check_state``) says which state is not at its reset value.
spikingjelly's, snntorch's and norse's are built in; another library fits the same methods
(``register_adapter``). A library the process has not imported is never matched, and never
imported: a conventional model pays nothing.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import NoReturn

import torch

from spikingsail.errors import ConfigError

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

    def set_backend(self, backend: str, device: torch.device, source: str) -> None:
        """Run the neurons on ``backend``'s kernels (``snn.backend``; "auto": the library's own choice)."""
        if backend != "auto":
            raise ConfigError(
                f"{source}: snn.backend is {backend!r}, but the model's neurons are {self.name}'s",
                f"{self.name} has no neuron kernels to choose between: its neurons are torch operations",
                'drop snn.backend; to fuse the neurons\' operations, compile the model ("compile": '
                '{"enabled": true})',
            )

    def carried_state(self, module: torch.nn.Module) -> list[str] | None:
        """The names of ``module``'s state variables that are not at their reset value (``[]``: all
        fresh); None when this adapter cannot tell (``snn.check_state`` then refuses the model)."""
        return None

    def state_buffers(self, module: torch.nn.Module) -> list[str]:
        """Names of ``module``'s buffers that hold neuron state (per rank: DDP must not broadcast them)."""
        return []


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

    def set_backend(self, backend: str, device: torch.device, source: str) -> None:
        from spikingsail.snn.kernels import select

        select(backend, device, source)

    def carried_state(self, module: torch.nn.Module) -> list[str]:
        memories: dict[str, object] = module._memories  # type: ignore[assignment]
        reset_values: dict[str, object] = module._memories_rv  # type: ignore[assignment]
        return [name for name, value in memories.items() if not _same(value, reset_values.get(name))]


class SnnTorchAdapter(SpikingAdapter):
    """snntorch: neurons are ``SpikingNeuron`` subclasses keeping their state (``mem``, ``syn``,
    ``spk``…) in non-persistent buffers, zeroed by ``reset_mem()``. snntorch has no multi-step mode:
    the script calls the model once per time step."""

    name = "snntorch"

    def available(self) -> bool:
        return "snntorch" in sys.modules

    def stateful_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        neuron = sys.modules["snntorch"].SpikingNeuron
        return [m for m in model.modules() if isinstance(m, neuron)]

    def reset(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            module.reset_mem()  # type: ignore[operator]  # every snntorch neuron has it

    def set_step_mode(self, model: torch.nn.Module, step_mode: str) -> None:
        if step_mode != "s":
            _refuse_step_mode(
                step_mode, self.name,
                "snntorch neurons take one time step per call; there is no multi-step mode to switch to",
                'drop snn.step_mode (or set "s") and loop over the time steps in the model or the script',
            )  # fmt: skip

    def state_buffers(self, module: torch.nn.Module) -> list[str]:
        return [
            n for n, b in module._buffers.items() if b is not None and n in module._non_persistent_buffers_set
        ]

    def carried_state(self, module: torch.nn.Module) -> list[str]:
        return [n for n in self.state_buffers(module) if bool(getattr(module, n).detach().ne(0).any())]


class NorseAdapter(SpikingAdapter):
    """norse: neuron modules (``LIFCell``, ``LIF``, …) are stateless — each call takes a state and
    returns the next, ``None`` meaning the initial one. State carries over where a module of the
    model keeps what they return (``z, self.state = self.cell(x, self.state)``). The stateful modules
    are therefore the model's own modules that hold norse neurons; resetting sets every attribute
    that holds a norse state (or a list or tuple of them, as ``SequentialState`` returns) to None."""

    name = "norse"

    def available(self) -> bool:
        return "norse.torch.module.snn" in sys.modules

    def stateful_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        neuron_types = self._neuron_types()
        holders = []
        for module in model.modules():
            if isinstance(module, neuron_types) or type(module).__module__.startswith("norse."):
                continue
            if any(isinstance(m, neuron_types) for m in module.modules()):
                holders.append(module)
        return holders

    def reset(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            for name in self.carried_state(module):
                setattr(module, name, None)

    def set_step_mode(self, model: torch.nn.Module, step_mode: str) -> None:
        _refuse_step_mode(
            step_mode, self.name,
            "norse fixes the step mode by module class: LIFCell takes one time step per call, LIF a [T, N, ...] sequence",
            "drop snn.step_mode and build the model from the cell or the sequence modules",
        )  # fmt: skip

    def carried_state(self, module: torch.nn.Module) -> list[str]:
        return [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and _is_norse_state(value)
        ]

    @staticmethod
    def _neuron_types() -> tuple[type, ...]:
        snn = sys.modules["norse.torch.module.snn"]
        return tuple(
            getattr(snn, n) for n in ("SNN", "SNNCell", "SNNRecurrent", "SNNRecurrentCell") if hasattr(snn, n)
        )


def _refuse_step_mode(step_mode: str, library: str, why: str, fix: str) -> NoReturn:
    raise ConfigError(f"snn.step_mode is {step_mode!r}, but the model's neurons are {library}'s", why, fix)


def _is_norse_state(value: object) -> bool:
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return any(_is_norse_state(v) for v in value)
    return isinstance(value, tuple) and type(value).__module__.startswith("norse.")


def _same(value: object, reset_value: object) -> bool:
    if isinstance(reset_value, torch.Tensor):
        return (
            isinstance(value, torch.Tensor)
            and value.shape == reset_value.shape
            and bool(torch.equal(value, reset_value))
        )
    return not isinstance(value, torch.Tensor) and value == reset_value


_ADAPTERS: list[SpikingAdapter] = [SpikingJellyAdapter(), SnnTorchAdapter(), NorseAdapter()]


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
