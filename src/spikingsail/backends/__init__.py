"""Backends by name. Optional ones (DeepSpeed, FSDP2, Horovod) are imported only when chosen."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from spikingsail.backends.base import Backend
from spikingsail.config import SailConfig
from spikingsail.config import load_config as _load_config
from spikingsail.errors import BackendError, ConfigError

# name -> "module:Class", so that choosing one backend never imports another's dependencies.
_REGISTRY: dict[str, str] = {
    "ddp": "spikingsail.backends.ddp:DDPBackend",
    "fsdp": "spikingsail.backends.fsdp:FSDPBackend",
    "deepspeed": "spikingsail.backends.deepspeed:DeepSpeedBackend",
    "horovod": "spikingsail.backends.horovod:HorovodBackend",
}
# section -> "module:Dataclass": the top-level config sections a backend owns (its options), checked
# at the config boundary like the table's own. The module must import without the backend's library.
_SECTIONS: dict[str, str] = {
    "horovod": "spikingsail.backends.horovod:HorovodConfig",
}

__all__ = ["Backend", "available", "backend_class", "config_sections", "load_config", "sharding_backends"]


def available() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str, where: str = "<config>") -> type[Backend]:
    target = _REGISTRY.get(name.lower())
    if target is None:
        raise BackendError(
            f"{where}: sail.backend '{name}' is not a SpikingSail backend",
            fix=f"choose one of: {', '.join(available())}",
        )
    cls: type[Backend] = _resolve(target)
    return cls


def config_sections() -> dict[str, type[Any]]:
    """Every backend's own config sections, by name."""
    return {name: _resolve(target) for name, target in _SECTIONS.items()}


class _Library:
    """``config.parse.Library`` for the registered backends: each backend class says what it and
    its library make of a config (an unknown name is refused once the config is read)."""

    def data_parallel_size(self, backend: str, world_size: int, sections: dict[str, Any]) -> int:
        return (
            backend_class(backend).data_parallel_size(world_size, sections)
            if backend in _REGISTRY
            else world_size
        )

    def checks(self, backend: str) -> frozenset[str]:
        return backend_class(backend).checked_by_deepspeed() if backend in _REGISTRY else frozenset()

    def keys(self, config: SailConfig) -> frozenset[str] | None:
        backend = config.sail.backend.lower()
        return backend_class(backend).library_keys(config) if backend in _REGISTRY else None


def load_config(source: str | Path | dict[str, Any] | None, world_size: int) -> SailConfig:
    """``spikingsail.config.load_config`` with the backends' sections and what their libraries read,
    the batch sizes counting the chosen backend's data-parallel replicas of ``world_size`` processes:
    how a user's config is read."""
    config = _load_config(source, world_size, config_sections(), _Library())
    if config.sail.backend.lower() not in _REGISTRY:  # a backend SpikingSail has, by name; its library
        raise ConfigError(  # is checked when it is chosen, not here
            f"{config.source}: sail.backend is {config.sail.backend!r}",
            "it names the engine backend that runs the job",
            f"use one of: {', '.join(available())}",
        )
    return config


def _resolve(target: str) -> Any:
    module_name, _, name = target.partition(":")
    return getattr(importlib.import_module(module_name), name)


def sharding_backends(stage: int) -> list[str]:
    """The backends that implement ``zero_optimization.stage`` ``stage`` (imports each to ask)."""
    return [name for name in available() if backend_class(name).max_zero_stage >= stage]
