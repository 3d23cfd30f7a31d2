"""When the engine resets neuron state, following the ``snn`` config section.

Spiking neurons keep a membrane potential from one call to the next; between independent batches
it must go back to its reset value, or one batch leaks into the next (and under gradient
accumulation into the next micro-batch). With ``snn.reset: "per_batch"`` (the default) the state
is reset

* after every ``engine.backward`` — a micro-batch ends with its backward;
* before every forward in multi-step mode — one call sees a whole ``[T, N, ...]`` batch;
* when an ``engine.dataloader`` hands out a batch, and when the engine switches between train and
  eval — in single-step mode a batch takes T forward calls, so the batch boundary comes from there;
* after a checkpoint load — state is not part of a checkpoint.

``"off"`` leaves all of it to the script (streaming / truncated-BPTT setups that carry state).

``snn.check_state`` (a debug mode) checks that promise instead of trusting it: before the first
forward after each of those boundaries (every forward in multi-step mode), every neuron's state must
be at its reset value, or the engine fails naming the module, the state and the boundary. It catches
a script with ``reset: "off"`` that forgets a reset, and a neuron whose ``reset()`` misses its state.
"""

from __future__ import annotations

import logging

import torch

from spikingsail.config.schema import SNNConfig
from spikingsail.errors import ConfigError, SailError
from spikingsail.snn.adapters import SpikingAdapter, find_adapter

log = logging.getLogger(__name__)


class SpikingSupport:
    def __init__(
        self,
        config: SNNConfig,
        adapter: SpikingAdapter | None,
        modules: list[torch.nn.Module],
        model: torch.nn.Module | None = None,
    ) -> None:
        self.config = config
        self.adapter = adapter
        self.modules = modules
        self.resets = 0
        self.names = {id(m): name for name, m in model.named_modules()} if model is not None else {}
        self._boundary: str | None = "the engine's start"

    @classmethod
    def for_model(
        cls, config: SNNConfig, model: torch.nn.Module, source: str, device: torch.device | None = None
    ) -> SpikingSupport:
        found = find_adapter(model) if config.enabled is not False else None
        if found is None:
            if config.backend != "auto" and config.enabled is not False:
                raise ConfigError(
                    f"{source}: snn.backend is {config.backend!r}, but the model has no spiking neurons",
                    "the setting chooses the kernels of spikingjelly's neurons",
                    "drop snn.backend, or build the model from spikingjelly neurons",
                )
            if config.enabled:
                raise ConfigError(
                    f"{source}: snn.enabled is true, but the model has no spiking neurons",
                    "SpikingSail recognises spikingjelly's stateful modules (activation_based MemoryModule)",
                    "build the model from spikingjelly neurons, register an adapter "
                    "(spikingsail.snn.register_adapter), or drop snn.enabled",
                )
            return cls(config, None, [])
        adapter, modules = found
        if config.step_mode is not None:
            adapter.set_step_mode(model, config.step_mode)
        adapter.set_backend(config.backend, device or torch.device("cpu"), source)
        if config.check_state and adapter.carried_state(modules[0]) is None:
            raise ConfigError(
                f"{source}: snn.check_state is true, but the {adapter.name} adapter cannot read a neuron's state",
                "the check compares every neuron's state with its reset value at each boundary",
                "give the adapter a carried_state method, or drop snn.check_state",
            )
        log.debug("%d %s neuron module(s); reset policy %s", len(modules), adapter.name, config.reset)
        return cls(config, adapter, modules, model)

    @property
    def active(self) -> bool:
        return self.adapter is not None

    @property
    def manages_state(self) -> bool:
        return self.adapter is not None and self.config.reset == "per_batch"

    @property
    def multi_step(self) -> bool:
        return bool(self.modules) and all(getattr(m, "step_mode", "s") == "m" for m in self.modules)

    def reset(self) -> None:
        """Reset every neuron now (also available to scripts as ``engine.reset_neurons()``)."""
        if self.adapter is not None:
            self.adapter.reset(self.modules)
            self.resets += 1

    def before_forward(self) -> None:
        if self.manages_state and self.multi_step:
            self.reset()
        if self.config.check_state and self.adapter is not None:
            boundary = self._boundary or ("a multi-step call" if self.multi_step else None)
            self._boundary = None
            if boundary is not None:
                self.check(boundary)

    def after_backward(self, boundary: bool = False) -> None:
        if self.manages_state:
            self.reset()
        self._boundary = (
            "an accumulation boundary (optimizer step)" if boundary else "a micro-batch's end (backward)"
        )

    # the engine's step hooks (``engine/hooks.py``), added when the model has spiking neurons
    forward_begin = before_forward
    backward_end = after_backward

    def on_batch(self) -> None:
        if self.manages_state and not self.multi_step:
            self.reset()
        self._boundary = self._boundary or "a new batch from engine.dataloader"

    def on_mode_change(self) -> None:
        if self.manages_state:
            self.reset()
        self._boundary = "a train/eval switch"

    def after_load(self) -> None:
        if self.active:
            self.reset()
        self._boundary = "a checkpoint load"

    def check(self, boundary: str) -> None:
        """Raise ``StateLeakError`` naming the first neuron whose state crossed ``boundary``."""
        assert self.adapter is not None
        for module in self.modules:
            carried = self.adapter.carried_state(module)
            if carried:
                name = self.names.get(id(module), type(module).__name__) or "<the model>"
                raise StateLeakError(
                    f"snn.check_state: neuron '{name}' ({self.adapter.name} {type(module).__name__}) "
                    f"carries state ({', '.join(carried)}) across {boundary}",
                    "each micro-batch must start from the reset state: carried over, the previous batch "
                    "leaks into this one (and into its gradient), so batches are no longer independent "
                    "and a resumed, re-batched or re-sharded run trains differently",
                    'with snn.reset "off", reset the neurons at this boundary (engine.reset_neurons()); '
                    'with "per_batch", this module\'s reset does not clear that state: fix its reset, or '
                    "keep the state in the library's own state variables",
                )


class StateLeakError(SailError):
    """A neuron's state crossed a boundary where it must be reset (``snn.check_state``)."""
