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
"""

from __future__ import annotations

import logging

import torch

from spikingsail.config.schema import SNNConfig
from spikingsail.errors import ConfigError
from spikingsail.snn.adapters import SpikingAdapter, find_adapter

log = logging.getLogger(__name__)


class SpikingSupport:
    def __init__(
        self, config: SNNConfig, adapter: SpikingAdapter | None, modules: list[torch.nn.Module]
    ) -> None:
        self.config = config
        self.adapter = adapter
        self.modules = modules
        self.resets = 0

    @classmethod
    def for_model(cls, config: SNNConfig, model: torch.nn.Module, source: str) -> SpikingSupport:
        found = find_adapter(model) if config.enabled is not False else None
        if found is None:
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
        log.debug("%d %s neuron module(s); reset policy %s", len(modules), adapter.name, config.reset)
        return cls(config, adapter, modules)

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

    def after_backward(self) -> None:
        if self.manages_state:
            self.reset()

    def on_batch(self) -> None:
        if self.manages_state and not self.multi_step:
            self.reset()

    def on_mode_change(self) -> None:
        if self.manages_state:
            self.reset()

    def after_load(self) -> None:
        if self.active:
            self.reset()
